"""Hugging Face Llama import/export (tools/checkpoint/convert.py) against transformers itself.

A tiny random LlamaForCausalLM (GQA 4:2, Llama-3 RoPE scaling, untied, weights and norms
drawn with std 0.3 so that a swapped q/k layout, gate/up order, RoPE base or KV grouping
moves the loss far beyond the tolerance) is saved locally and converted. Through
pretrain_gpt.py (``--load CK --skip-train``, a validation set made of the fixed tokens) the
loss equals transformers' at TP=1 and TP=2 within 1e-5; the logits equal within 1e-5; the
export HF -> ours -> HF is bit-exact. Offline: nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from harness import run_distributed  # noqa: E402
from harness.hf_llama import hf_llama_sizes  # noqa: E402
from harness.runs import REPO_ROOT  # noqa: E402

from tools.checkpoint.hf_llama import ConversionError, hf_to_mcore, mcore_to_hf, model_flags, shape_from_hf, vocab_divisor  # noqa: E402,E501

SEQ, VOCAB = 32, 250
CONVERT = ["-m", "tools.checkpoint.convert"]  # run from REPO_ROOT
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def _tiny_llama(path: str, seed: int = 0, **overrides) -> None:
    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=16384,
              tie_word_embeddings=False, initializer_range=0.3, rope_parameters=dict(ROPE))
    kw.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (SEQ + 1,), generator=torch.Generator().manual_seed(5))


def _hf_logits(hf_dir: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=_tokens()[None, :-1]).logits[0]


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(HF dir, checkpoint, printed model flags, validation data prefix)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("hf")
    hf_dir, ckpt, data = str(root / "hf"), str(root / "ckpt"), str(root / "valid")
    _tiny_llama(hf_dir)
    out = _run([sys.executable, *CONVERT, "hf-to-mcore", "--hf-dir", hf_dir, "--save", ckpt,
                "--tensor-model-parallel-size", "2", "--seq-length", str(SEQ)])
    assert out.returncode == 0, out.stderr[-3000:]
    flags = out.stdout.strip().splitlines()[-1].split(" --tokenizer-type")[0].split()
    builder = IndexedDatasetBuilder(data + ".bin", dtype=np.int32)
    builder.add_document(np.array(_tokens().tolist(), dtype=np.int32), [SEQ + 1])
    builder.finalize(data + ".idx")
    return hf_dir, ckpt, flags, data


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_pretrain_gpt_validation_loss_equals_transformers(converted, tp):
    hf_dir, ckpt, flags, data = converted
    logits = _hf_logits(hf_dir)
    expected = torch.nn.functional.cross_entropy(logits.double(), _tokens()[1:]).item()
    # NullTokenizer --vocab-size N: ids 0..N-1 plus EOD N, so the model's vocabulary is VOCAB.
    args = flags + ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1), "--seq-length", str(SEQ),
                    "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "0", "--skip-train",
                    "--eval-iters", "1", "--data-path", data, "--split", "0,1,0", "--load", ckpt,
                    "--hidden-dropout", "0", "--attention-dropout", "0", "--tensor-model-parallel-size", str(tp)]
    if tp == 1:
        out = _run([sys.executable, "pretrain_gpt.py"] + args)
        assert out.returncode == 0, out.stderr[-3000:]
        out = out.stdout
    else:  # pretrain_gpt.main on 2 spawned gloo ranks (the harness stops them by PID)
        rc, out = run_distributed(_pretrain_gpt_main, 2, args, timeout=300)[0]
        assert rc == 0, out[-3000:]
    found = re.findall(r"validation loss at iteration 0 \| lm loss value: ([0-9.E+-]+)", out)
    assert len(found) == 1, out[-2000:]
    assert abs(float(found[0]) - expected) <= 1e-5 * expected, (found[0], expected)
    assert f"padded vocab {VOCAB}" in out  # no padded logits enter the softmax


def _pretrain_gpt_main(rank, world_size, argv):
    import contextlib
    import io

    import pretrain_gpt

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        rc = pretrain_gpt.main(argv)
    return rc, log.getvalue()


def _our_logits(rank, world_size, ckpt):
    from tools.checkpoint.convert import load_model

    _, _, _, model = load_model(ckpt)
    tokens = _tokens()[None, :-1]
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ)[None], None)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    return logits[0].float()


@pytest.mark.distributed
def test_logits_equal_and_export_round_trip_is_bit_exact(converted, tmp_path):
    from safetensors.torch import load_file

    hf_dir, ckpt, _, _ = converted
    reference = _hf_logits(hf_dir)
    ours = run_distributed(_our_logits, 1, ckpt, timeout=300)[0]
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()
    out_dir = str(tmp_path / "exported")
    out = _run([sys.executable, *CONVERT, "mcore-to-hf", "--load", ckpt, "--hf-dir", out_dir])
    assert out.returncode == 0, out.stderr[-3000:]
    before, after = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(
        os.path.join(out_dir, "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert torch.equal(_hf_logits(out_dir), reference)  # transformers reads the exported config alike


def test_both_config_forms_give_the_same_flags(tmp_path):
    new_form = str(tmp_path / "v5")
    _tiny_llama(new_form)
    config = json.load(open(os.path.join(new_form, "config.json")))
    assert "rope_parameters" in config
    old = json.loads(json.dumps(config))
    params = old.pop("rope_parameters")
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = params
    old_form = str(tmp_path / "v4")
    shutil.copytree(new_form, old_form)
    json.dump(old, open(os.path.join(old_form, "config.json"), "w"))
    assert model_flags(shape_from_hf(old)) == model_flags(shape_from_hf(config))
    assert "--use-rope-scaling" in model_flags(shape_from_hf(old))
    assert torch.equal(_hf_logits(old_form), _hf_logits(new_form))


def test_vocab_divisor_leaves_no_padding():
    assert vocab_divisor(128256, 1) == 128 and vocab_divisor(128256, 8) == 96
    for vocab, tp in ((128256, 8), (151936, 4), (250, 2), (32000, 8)):
        d = vocab_divisor(vocab, tp)
        assert vocab % (d * tp) == 0
    assert vocab_divisor(251, 2) is None
    with pytest.raises(ConversionError, match="no --make-vocab-size-divisible-by"):
        model_flags(shape_from_hf(dict(_config(), vocab_size=251)), 2)


def _config(**kw) -> dict:
    base = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0)
    base.update(kw)
    return base


@pytest.mark.parametrize("variant", ["tied", "qwen2-qkv-bias", "mha"])
def test_tensor_mapping_round_trips(variant):
    cfg = {"tied": _config(tie_word_embeddings=True), "qwen2-qkv-bias": _config(model_type="qwen2"),
           "mha": _config(num_key_value_heads=4)}[variant]
    shape = shape_from_hf(cfg)
    g = torch.Generator().manual_seed(1)
    tensors = {k: torch.randn(s, generator=g) for k, s in hf_llama_sizes(shape, VOCAB).items()}
    state = hf_to_mcore(shape, tensors, padded_vocab=256)
    assert state["embedding.word_embeddings.weight"].shape[0] == 256
    assert ("output_layer.weight" in state) != shape.tied
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in state) == shape.qkv_bias
    back = mcore_to_hf(shape, state)
    assert sorted(back) == sorted(tensors)
    for k in tensors:
        assert torch.equal(back[k], tensors[k]), k


def test_wrong_layout_is_one_line_naming_the_tensor(converted, tmp_path):
    hf_dir = converted[0]
    bad = str(tmp_path / "bad")
    shutil.copytree(hf_dir, bad)
    config = json.load(open(os.path.join(bad, "config.json")))
    config["num_key_value_heads"] = 1  # the k/v projections were saved for 2 KV heads
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    out = _run([sys.executable, *CONVERT, "hf-to-mcore", "--hf-dir", bad, "--save", str(tmp_path / "ck")])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: tensor model.layers.0.self_attn.k_proj.weight has shape (32, 64), the config gives (16, 64)"]
