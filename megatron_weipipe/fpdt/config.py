"""Typed configuration for the FPDT / Ulysses building blocks.

Every rule that can be checked before a process group is touched is checked here, so a
bad combination fails at start-up with one sentence instead of hanging a collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_weipipe.errors import require
from megatron_weipipe.flags import option

# FPDT's block attention kernels (fpdt/kernels.py builds its table of classes from these
# names, in this order); FPDTConfig.kernel takes one of them or "auto" (picked per device).
AUTO_KERNEL = "auto"
BLOCK_KERNELS = ("math", "cpu_flash", "cudnn", "cuda_flash", "cuda_efficient")
KERNELS = (AUTO_KERNEL, *BLOCK_KERNELS)
CAUSAL_NAMES = ("causal", "AttnMaskType.causal")


@dataclass(frozen=True)
class RotaryConfig:
    """Megatron's rotary convention (RotaryEmbedding + _apply_rotary_pos_emb_bshd).

    ``percent`` < 1 rotates only the first ``int(head_dim * percent)`` channels;
    ``seq_len_interpolation_factor`` divides positions; ``rope_scaling`` is the Llama-3.1
    frequency rescaling that Megatron applies with ``--use-rope-scaling``.
    """

    base: float = 10000.0
    percent: float = 1.0
    interleaved: bool = False
    seq_len_interpolation_factor: float | None = None
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0

    def validate(self, head_dim: int) -> None:
        if not 0.0 < self.percent <= 1.0:
            raise ValueError(f"rotary percent must be in (0, 1], got {self.percent}")
        rot = int(head_dim * self.percent)
        if rot < 2 or rot % 2:
            raise ValueError(
                f"rotary dimension int(head_dim*percent)={rot} must be even and >= 2 (head_dim={head_dim})"
            )


@dataclass(frozen=True)
class AttentionSpec:
    """Shape of one self-attention layer, in Megatron's terms (per tensor-parallel rank).

    ``num_heads`` / ``num_query_groups`` are the counts held by this tensor-parallel rank
    (Megatron's ``*_per_partition``); ``hidden_size`` is the full model width (the input
    width of linear_qkv). ``rotary`` None means no rotary embedding.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    num_query_groups: int | None = None
    rotary: RotaryConfig | None = field(default_factory=RotaryConfig)
    softmax_scale: float | None = None
    attn_mask_type: str = "causal"
    attention_dropout: float = 0.0

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.groups

    def kv_replicas(self, cp_size: int) -> int:
        """Ranks of the context-parallel group that share one KV head (1: none share)."""
        return cp_heads_fit(self.num_heads, self.groups, cp_size,
                            names=("num_heads (per TP rank)", "num_query_groups (per TP rank)"))

    @property
    def qkv_size(self) -> int:
        """Output width of linear_qkv: per group, [q heads of the group, k, v] x head_dim."""
        return self.groups * (self.heads_per_group + 2) * self.head_dim

    @property
    def proj_input_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def validate(self, cp_size: int = 1) -> None:
        mask = str(self.attn_mask_type)
        if mask not in CAUSAL_NAMES:
            raise ValueError(f"attn_mask_type={mask!r} is not supported: FPDT/Ulysses attention is causal only")
        if self.attention_dropout:
            raise ValueError(f"attention_dropout={self.attention_dropout} is not supported: set it to 0")
        if self.num_heads % self.groups:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_query_groups={self.groups}"
            )
        self.kv_replicas(cp_size)
        if self.rotary is not None:
            self.rotary.validate(self.head_dim)


@dataclass(frozen=True)
class FPDTConfig:
    """How the sequence is chunked and where chunk state lives; the FPDT flags and their rules.

    enabled: ``--fpdt``; with context parallelism but without it, attention is plain Ulysses.
    chunk_size: C, in GLOBAL tokens after the all-to-all (DeepSpeed's
        ``--ds-sequence-parallel-fpdt-chunk-size``). None means one chunk, which is plain
        Ulysses with no extra work.
    offload: keep per-chunk q/k/v/o/lse/layer-input in host memory (pinned on CUDA),
        double-buffered back to the device.
    kernel: block attention kernel, see fpdt.kernels ("auto" picks by device, dtype and
        head_dim; on CUDA the first of cudnn / cuda_flash / cuda_efficient that passes a
        self-check at first use).
    overlap_comm: launch the next chunk's all-to-all before computing on the current one.
    mlp_chunks / loss_chunks: number of sequence chunks for the MLP and the output
        layer + cross-entropy (None: same count as attention).
    """

    enabled: bool = option(False, flag="--fpdt", help="chunked Ulysses attention (FPDT) over the context-parallel "
                                                      "group, with chunked MLP and loss")
    chunk_size: int | None = option(65536, flag="--fpdt-chunk-size",
                                    help="FPDT chunk, in tokens of the whole sequence")
    offload: bool = option(False, flag="--fpdt-offload", help="keep FPDT chunk state in host memory, "
                                                             "double-buffered back to the device")
    kernel: str = "auto"
    overlap_comm: bool = True
    mlp_chunks: int | None = None
    loss_chunks: int | None = None

    def num_chunks(self, seq_len: int) -> int:
        """u = S / C for a GLOBAL sequence length S."""
        if self.chunk_size is None:
            return 1
        return max(1, seq_len // self.chunk_size)

    def mlp_num_chunks(self, seq_len: int) -> int:
        """Sequence chunks for chunked_mlp (default: the attention's chunk count)."""
        return self.mlp_chunks or self.num_chunks(seq_len)

    def loss_num_chunks(self, seq_len: int) -> int:
        """Sequence chunks for chunked_cross_entropy (default: the attention's chunk count)."""
        return self.loss_chunks or self.num_chunks(seq_len)

    def validate(self, seq_len: int, cp_size: int = 1) -> int:
        """Check the layout for a global sequence length (raises ConfigError); return the chunk count u.

        The one home of the FPDT rules: start-up, the simulator and direct calls of the
        kernels all check here.
        """
        require(self.kernel in KERNELS, f"kernel={self.kernel!r} is not one of {KERNELS}")
        C = self.chunk_size
        if C is not None:
            require(C > 0, "--fpdt-chunk-size must be positive")
            require(C <= seq_len, f"--fpdt-chunk-size ({C}) must not exceed --seq-length ({seq_len})")
            require(seq_len % C == 0, f"--seq-length ({seq_len}) must be a multiple of --fpdt-chunk-size ({C})")
            require(C % cp_size == 0,
                    f"--fpdt-chunk-size ({C}) must be divisible by --context-parallel-size ({cp_size})")
        u = self.num_chunks(seq_len)
        check_layout(seq_len, cp_size, u)
        for name in ("mlp_chunks", "loss_chunks"):
            n = getattr(self, name)
            require(n is None or (n > 0 and (seq_len // cp_size) % n == 0),
                    f"{name}={n} must divide the local sequence length {seq_len // cp_size}")
        return u


def cp_heads_fit(heads: int, groups: int, cp: int, tp: int = 1,
                 names: tuple[str, str] = ("--num-attention-heads", "--num-query-groups")) -> int:
    """The Ulysses head rule; returns how many ranks share each KV head.

    After the all-to-all each of the cp x tp ranks holds heads / (cp x tp) query heads, so
    the query heads must divide evenly. KV heads either divide too (each rank holds its
    own), or divide cp x tp: then cp x tp / groups ranks hold the query heads of one KV
    head, and that head is sent to each of them (Ulysses' ``spread_kv``), its gradients
    summed back onto the rank whose tokens it came from (``gather_kv``).
    """
    n = cp * tp
    require(heads % n == 0,
            f"{names[0]} ({heads}) must be divisible by context x tensor parallel size "
            f"({cp} x {tp}) for Ulysses attention")
    require(groups % n == 0 or n % groups == 0,
            f"{names[1]} ({groups}) must divide or be divisible by context x tensor parallel size "
            f"({cp} x {tp}) for Ulysses attention")
    return max(1, n // groups)


def kv_heads_per_rank(groups: int, cp: int, tp: int = 1) -> int:
    """KV heads each rank holds after the Ulysses all-to-all (a shared head counts once)."""
    return max(1, groups // (cp * tp))


def ulysses_heads_sent(heads: int, groups: int, cp: int, tp: int = 1) -> int:
    """Heads per token in one TP rank's q|k|v all-to-all send buffer: its query heads, and
    k and v of each KV head once per rank that holds its query heads (the all-to-all of
    o, do and dq|dk|dv: heads / tp, and this again)."""
    return heads // tp + 2 * cp * kv_heads_per_rank(groups, cp, tp)


def check_layout(seq_len: int, cp_size: int, num_chunks: int) -> None:
    """The FPDT layout needs S divisible by u*P (u chunks of C = S/u tokens, P pieces each)."""
    require(cp_size > 0 and num_chunks > 0, f"cp_size={cp_size} and num_chunks={num_chunks} must be positive")
    require(seq_len % (num_chunks * cp_size) == 0,
            f"sequence length {seq_len} is not divisible by chunks x context-parallel size "
            f"= {num_chunks} x {cp_size}")


def attention_spec_from_megatron(
    config,
    tp_size: int = 1,
    rotary: RotaryConfig | None = None,
) -> AttentionSpec:
    """AttentionSpec for one TP rank from a megatron-core TransformerConfig (duck-typed).

    Rotary settings live on GPTModel in Megatron (rotary_base, rotary_percent,
    seq_len_interpolation_factor, rope_scaling), so pass them as ``rotary``; None means
    no rotary embedding (e.g. learned absolute positions).
    """
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    if heads % tp_size or groups % tp_size:
        raise ValueError(
            f"num_attention_heads={heads} and num_query_groups={groups} must be divisible by the TP size {tp_size}"
        )
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=heads // tp_size,
        head_dim=config.kv_channels or config.hidden_size // heads,
        num_query_groups=groups // tp_size,
        rotary=rotary,
        softmax_scale=getattr(config, "softmax_scale", None),
        attention_dropout=getattr(config, "attention_dropout", 0.0),
    )
