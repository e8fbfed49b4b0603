"""The tensor names and sizes of a Hugging Face Llama (or Qwen2) checkpoint of a shape, for
tests that build one without downloading anything."""

from __future__ import annotations


def hf_llama_sizes(shape, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """name -> size of every tensor a checkpoint of ``shape`` (tools/checkpoint/hf_llama.py's
    shape) holds: the output layer only when untied, the QKV biases only when it has them."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    sizes = {"model.embed_tokens.weight": (vocab_size, h), "model.norm.weight": (h,)}
    if not shape.tied:
        sizes["lm_head.weight"] = (vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sizes.update({p + "self_attn.q_proj.weight": (shape.num_heads * d, h),
                      p + "self_attn.k_proj.weight": (shape.num_kv_heads * d, h),
                      p + "self_attn.v_proj.weight": (shape.num_kv_heads * d, h),
                      p + "self_attn.o_proj.weight": (h, shape.num_heads * d), p + "input_layernorm.weight": (h,),
                      p + "post_attention_layernorm.weight": (h,), p + "mlp.gate_proj.weight": (f, h),
                      p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)})
        if shape.qkv_bias:
            sizes.update({p + "self_attn.q_proj.bias": (shape.num_heads * d,),
                          p + "self_attn.k_proj.bias": (shape.num_kv_heads * d,),
                          p + "self_attn.v_proj.bias": (shape.num_kv_heads * d,)})
    return sizes
