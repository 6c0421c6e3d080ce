"""Official EAGLE checkpoints: a torch-written EAGLE-3 file loads and drafts exactly as a torch
re-implementation of the reference forward does; export and import round-trip; mismatches and
corrupt files are refused with the problem named."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.drafters import eagle
from specjax.drafters.eagle import EagleConfig
from specjax.io import official
from specjax.models import attention as attn
from specjax.models import target
from specjax.targets import DecoderTarget

TARGET = ModelConfig(arch="llama", vocab_size=64, d_model=32, n_layers=6, n_heads=4,
                     n_kv_heads=2, head_dim=8, d_ff=48, rope_theta=500000.0)
TPARAMS = target.init_params(TARGET, 0, scale=0.3)
DRAFT_VOCAB = 40
D, N, K, HD, F = 32, 4, 2, 8, 40


def _official_eagle3(seed=0):
    """(config.json dict, {name: float32 torch tensor}) of a random EAGLE-3 drafter in the
    reference's layout, norms away from 1 so a swapped norm shows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.2 * torch.randn(*s, generator=g)  # noqa: E731
    ones = lambda: 1 + 0.1 * torch.randn(D, generator=g)  # noqa: E731
    used = np.sort(np.random.default_rng(seed).choice(TARGET.vocab_size, DRAFT_VOCAB, replace=False))
    t2d = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    t2d[torch.as_tensor(used)] = True
    sd = {
        "fc.weight": r(D, 3 * D), "midlayer.hidden_norm.weight": ones(),
        "midlayer.input_layernorm.weight": ones(),
        "midlayer.self_attn.q_proj.weight": r(N * HD, 2 * D),
        "midlayer.self_attn.k_proj.weight": r(K * HD, 2 * D),
        "midlayer.self_attn.v_proj.weight": r(K * HD, 2 * D),
        "midlayer.self_attn.o_proj.weight": r(D, N * HD),
        "midlayer.post_attention_layernorm.weight": ones(),
        "midlayer.mlp.gate_proj.weight": r(F, D), "midlayer.mlp.up_proj.weight": r(F, D),
        "midlayer.mlp.down_proj.weight": r(D, F), "norm.weight": ones(),
        "lm_head.weight": r(DRAFT_VOCAB, D),
        "d2t": torch.as_tensor(used - np.arange(DRAFT_VOCAB), dtype=torch.int64), "t2d": t2d,
    }
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": D, "intermediate_size": F,
              "num_attention_heads": N, "num_key_value_heads": K, "num_hidden_layers": 1,
              "rms_norm_eps": 1e-5, "vocab_size": TARGET.vocab_size,
              "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": 2048}
    return config, sd


def _torch_reference_step(sd, embed, taps, ids):
    """The reference EAGLE-3 draft step over T pairs (batch 1, causal, positions 0..T-1, RoPE
    base 10000, HF rotate_half), written from its description: returns (output, logits)."""
    import torch

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    def rope(x, pos):  # x [T, heads, HD]
        inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rot = torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1)
        return x * cos + rot * sin

    t = ids.shape[0]
    e = embed[ids]
    h = taps @ sd["fc.weight"].T
    x = torch.cat([rms(e, sd["midlayer.input_layernorm.weight"]),
                   rms(h, sd["midlayer.hidden_norm.weight"])], -1)
    p = "midlayer.self_attn."
    q = (x @ sd[p + "q_proj.weight"].T).view(t, N, HD)
    k = (x @ sd[p + "k_proj.weight"].T).view(t, K, HD)
    v = (x @ sd[p + "v_proj.weight"].T).view(t, K, HD)
    pos = torch.arange(t)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
    scores = torch.einsum("qnh,knh->nqk", q, k) / HD ** 0.5
    scores = scores.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), float("-inf"))
    o = torch.einsum("nqk,knh->qnh", scores.softmax(-1), v).reshape(t, N * HD)
    h = h + o @ sd[p + "o_proj.weight"].T
    m = rms(h, sd["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(m @ sd["midlayer.mlp.gate_proj.weight"].T) * (
        m @ sd["midlayer.mlp.up_proj.weight"].T)
    h = h + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    return h, rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


@pytest.mark.parametrize("file", ["pytorch_model.bin", "model.safetensors"])
def test_official_eagle3_drafts_like_the_reference_forward(tmp_path, file):
    import torch
    from safetensors.torch import save_file

    config, sd = _official_eagle3()
    (tmp_path / "config.json").write_text(json.dumps(config))
    if file == "pytorch_model.bin":
        torch.save(sd, tmp_path / file)
    else:
        save_file(sd, tmp_path / file)
    cfg, own = official.load_eagle(tmp_path, TARGET)
    assert cfg.version == 3 and cfg.taps == (2, 3, 3) and cfg.draft_vocab_size == DRAFT_VOCAB
    assert cfg.layer.rope_theta == 10000.0  # not the target's 500000

    t = 7
    gen = np.random.default_rng(1)
    ids = gen.integers(0, TARGET.vocab_size, (1, t))
    taps = gen.standard_normal((1, t, 3 * D)).astype(np.float32)
    params = eagle.drafter_params(own, TPARAMS)
    tgt = DecoderTarget(TARGET)
    x, res = eagle.layer_inputs(cfg, tgt, params, jnp.asarray(ids), jnp.asarray(taps), True)
    out, _, _ = eagle.decoder_layer(
        cfg, own, x, res, jnp.arange(t)[None],
        lambda k, v: [attn.KeyBlock(k, v, attn.Causal())])
    logits = eagle.draft_logits(cfg, tgt, params, out)
    with torch.no_grad():
        want_out, want_logits = _torch_reference_step(
            {k: v.float() for k, v in sd.items()}, torch.as_tensor(np.array(TPARAMS["embed"])),
            torch.as_tensor(taps[0]), torch.as_tensor(ids[0]))
    np.testing.assert_allclose(np.asarray(out[0]), want_out.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.arange(DRAFT_VOCAB) + np.asarray(own["d2t"]),
                                  np.flatnonzero(sd["t2d"].numpy()))


@pytest.mark.parametrize("version", [3, 1])
def test_export_then_import_round_trips(tmp_path, version):
    cfg = (EagleConfig.eagle3(TARGET, draft_vocab_size=DRAFT_VOCAB) if version == 3
           else EagleConfig.eagle1(TARGET, fc_bias=True))
    own = eagle.init_params(cfg, 3, scale=0.2)
    if version == 3:
        own["d2t"] = jnp.asarray(eagle.draft_vocab(np.arange(TARGET.vocab_size), DRAFT_VOCAB))
    official.save_eagle(cfg, own, tmp_path)
    names = set(json.loads((tmp_path / "config.json").read_text()))
    assert {"hidden_size", "num_attention_heads", "vocab_size"} <= names
    cfg2, own2 = official.load_eagle(tmp_path, TARGET)
    assert cfg2 == cfg
    assert jax.tree.structure(own2) == jax.tree.structure(own)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 own, own2)


def _variant(tmp_path, config, sd, name):
    """A copy of the checkpoint with tensors ``sd`` in ``tmp_path / name``."""
    import torch

    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    torch.save(sd, path / "pytorch_model.bin")
    return path


def test_mismatches_and_corrupt_files_name_the_problem(tmp_path):
    import torch

    config, sd = _official_eagle3()
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"vocabulary \(64\) differs from the target's \(80\)"):
        official.load_eagle(tmp_path, TARGET.replace(vocab_size=80))
    with pytest.raises(ValueError, match="features of width 32, the target's hidden size is 48"):
        official.load_eagle(tmp_path, TARGET.replace(d_model=48))
    narrow = _variant(tmp_path, config, dict(sd, **{"fc.weight": torch.zeros(D, 2 * D)}), "fc")
    with pytest.raises(ValueError, match="fc.weight reads 64 features, not 3 taps x 32"):
        official.load_eagle(narrow, TARGET)
    bad = _variant(tmp_path, config, dict(sd, t2d=torch.zeros(TARGET.vocab_size, dtype=torch.bool)),
                   "t2d")
    with pytest.raises(ValueError, match="t2d .* does not mark exactly the ids d2t maps to"):
        official.load_eagle(bad, TARGET)
    missing = _variant(tmp_path, config, {k: v for k, v in sd.items() if k != "norm.weight"},
                       "missing")
    with pytest.raises(ValueError, match="missing tensor norm.weight"):
        official.load_eagle(missing, TARGET)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text(json.dumps(config))
    (tmp_path / "broken" / "pytorch_model.bin").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a torch zip checkpoint"):
        official.load_eagle(tmp_path / "broken", TARGET)


# ------------------------------------------------------------------------------------------
# DFlash.

DF_LAYERS, DF_BLOCK = 2, 4


def _official_dflash(seed=0, mask_token_id=60):
    """(config.json dict, {name: float32 torch tensor}) of a random DFlash drafter in the
    z-lab layout (block_size at top level, dflash_config), norms away from 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    r = lambda *s: 0.2 * torch.randn(*s, generator=g)  # noqa: E731
    ones = lambda n=D: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    ids = [1, 3, 4]
    sd = {"fc.weight": r(D, len(ids) * D), "hidden_norm.weight": ones(), "norm.weight": ones()}
    for i in range(DF_LAYERS):
        p = f"layers.{i}."
        sd |= {p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
               p + "self_attn.q_proj.weight": r(N * HD, D), p + "self_attn.k_proj.weight": r(K * HD, D),
               p + "self_attn.v_proj.weight": r(K * HD, D), p + "self_attn.o_proj.weight": r(D, N * HD),
               p + "self_attn.q_norm.weight": ones(HD), p + "self_attn.k_norm.weight": ones(HD),
               p + "mlp.gate_proj.weight": r(F, D), p + "mlp.up_proj.weight": r(F, D),
               p + "mlp.down_proj.weight": r(D, F)}
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
              "block_size": DF_BLOCK, "dflash_config": {"mask_token_id": mask_token_id,
                                                        "target_layer_ids": ids},
              "num_target_layers": TARGET.n_layers, "num_hidden_layers": DF_LAYERS,
              "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
              "num_key_value_heads": K, "head_dim": HD, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "rope_scaling": None, "vocab_size": TARGET.vocab_size,
              "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 6}
    return config, sd


def test_official_dflash_drafts_like_an_independent_dense_forward(tmp_path):
    """A torch-written z-lab-layout file loads, and its block pass equals a dense float64
    forward computed from the file's own tensors (not through our name table)."""
    import torch

    import dflash_reference
    from specjax.drafters import dflash

    config, sd = _official_dflash()
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    cfg, own = official.load_dflash(tmp_path, TARGET)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (DF_BLOCK, (1, 3, 4), 60)
    assert cfg.taps == (2, 4, 5) and cfg.causal(1) and not cfg.causal(0) and cfg.window(1) == 6
    tgt = DecoderTarget(TARGET)
    drafter = dflash.DFlashDrafter(cfg, tgt)
    dp = dflash.drafter_params(own, TPARAMS)
    prompt = jnp.asarray([[3, 9, 27, 1, 5, 8, 13, 2, 2]], jnp.int32)
    plen = jnp.asarray([9], jnp.int32)
    _, taps, _ = target.prefill(TPARAMS, TARGET, prompt, plen, 32, cfg.taps)
    from specjax.drafters.base import Prefill

    roots = jnp.asarray([11], jnp.int32)
    state = drafter.init(dp, Prefill(prompt, plen, taps, roots, 32))
    got = np.asarray(drafter.block_logits(dp, state, roots))[0]
    states = dflash_reference.block_states(
        {k: v.numpy() for k, v in sd.items()}, n_layers=DF_LAYERS, n_heads=N, n_kv_heads=K,
        head_dim=HD, eps=1e-6, theta=1e6, taps=np.asarray(taps[0]),
        block_emb=np.asarray(dflash.embed_block(cfg, tgt, dp, roots, DF_BLOCK)[0]),
        causal=lambda i: i == 1, window=lambda i: 6 if i == 1 else None)
    want = np.asarray(tgt.lm_head(TPARAMS, jnp.asarray(states, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("learned", [False, True], ids=["mask-token", "learned-mask"])
def test_dflash_export_then_import_round_trips(tmp_path, learned):
    from specjax.drafters import dflash
    from specjax.drafters.dflash import DFlashConfig

    cfg = DFlashConfig.for_target(TARGET, n_layers=2, block_size=8,
                                  mask_token_id=None if learned else 5, n_taps=3)
    own = dflash.init_params(cfg, 4, scale=0.2)
    official.save_dflash(cfg, own, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 8 and config["dflash_config"]["mask_token_id"] == (
        None if learned else 5)
    cfg2, own2 = official.load_dflash(tmp_path, TARGET)
    assert cfg2 == cfg
    assert jax.tree.structure(own2) == jax.tree.structure(own)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
                 own, own2)


def test_a_token_order_survives_export_and_can_be_added_later(tmp_path):
    """A ranking is saved as exact int32 ids beside bfloat16 weights, loads back, and
    ``set_token_order`` adds (or replaces) one in a drafter directory without touching the
    weights' bytes; a ranking that repeats an id is refused before anything is written."""
    from specjax.drafters import dflash
    from specjax.drafters.dflash import DFlashConfig
    from specjax.io.hf import SafetensorsFile

    cfg = DFlashConfig.for_target(TARGET, n_layers=1, block_size=4, n_taps=3)
    own = dflash.init_params(cfg, 5, scale=0.2)
    order = np.random.default_rng(1).permutation(TARGET.vocab_size).astype(np.int32)
    official.save_dflash(cfg, dict(own, token_order=jnp.asarray(order)), tmp_path / "a",
                         dtype="bfloat16")
    _, back = official.load_dflash(tmp_path / "a", TARGET)
    np.testing.assert_array_equal(np.asarray(back["token_order"]), order)
    official.save_dflash(cfg, own, tmp_path / "b", dtype="bfloat16")
    before = {k: np.asarray(v) for k, v in
              ((k, SafetensorsFile(tmp_path / "b" / "model.safetensors").get(k))
               for k in SafetensorsFile(tmp_path / "b" / "model.safetensors").keys())}
    with pytest.raises(ValueError, match="does not rank each of the 64 ids exactly once"):
        official.set_token_order(tmp_path / "b", np.zeros(TARGET.vocab_size, np.int32))
    _, plain = official.load_dflash(tmp_path / "b", TARGET)
    assert "token_order" not in plain
    for ranking in (order, order[::-1]):
        official.set_token_order(tmp_path / "b", ranking)
        f = SafetensorsFile(tmp_path / "b" / "model.safetensors")
        assert set(f.keys()) == set(before) | {"token_order"}
        for k, v in before.items():
            np.testing.assert_array_equal(np.asarray(f.get(k)), v)
        _, ranked = official.load_dflash(tmp_path / "b", TARGET)
        np.testing.assert_array_equal(np.asarray(ranked["token_order"]), ranking)
    # A default draft vocabulary goes into config.json beside it, and needs the ranking.
    official.set_token_order(tmp_path / "b", order, draft_vocab_size=20)
    cfg20, _ = official.load_dflash(tmp_path / "b", TARGET)
    assert cfg20.draft_vocab_size == 20
    official.save_dflash(cfg20, own, tmp_path / "c")
    with pytest.raises(ValueError, match="sets draft_vocab_size but .* has no token_order"):
        official.load_dflash(tmp_path / "c", TARGET)
    with pytest.raises(ValueError, match=r"a draft vocabulary of 65 ids must be in \[1, 64\]"):
        official.set_token_order(tmp_path / "b", order, draft_vocab_size=65)
    # An EAGLE-1 drafter takes a ranking the same way (a tensor beside its weights, exported
    # and loaded back), but no default size: its config.json keeps the official fields.
    ecfg = EagleConfig.eagle1(TARGET)
    eown = eagle.init_params(ecfg, 0)
    official.save_eagle(ecfg, eown, tmp_path / "eagle1")
    official.set_token_order(tmp_path / "eagle1", order)
    _, ranked = official.load_eagle(tmp_path / "eagle1", TARGET)
    np.testing.assert_array_equal(np.asarray(ranked["token_order"]), order)
    official.save_eagle(ecfg, ranked, tmp_path / "eagle1-again", dtype="bfloat16")
    _, again = official.load_eagle(tmp_path / "eagle1-again", TARGET)
    np.testing.assert_array_equal(np.asarray(again["token_order"]), order)
    with pytest.raises(ValueError, match="choose its draft vocabulary when drafting"):
        official.set_token_order(tmp_path / "eagle1", order, draft_vocab_size=20)
    # The same checks come before any ranking is counted ('data rank' calls them first).
    assert official.check_rankable(tmp_path / "eagle1") == TARGET.vocab_size
    assert official.check_rankable(tmp_path / "b", 64) == TARGET.vocab_size
    with pytest.raises(ValueError, match="choose its draft vocabulary when drafting"):
        official.check_rankable(tmp_path / "eagle1", 20)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        official.check_rankable(tmp_path / "nowhere")
    e3 = EagleConfig.eagle3(TARGET, draft_vocab_size=DRAFT_VOCAB)
    e3own = dict(eagle.init_params(e3, 0), d2t=jnp.asarray(
        eagle.draft_vocab(np.arange(TARGET.vocab_size), DRAFT_VOCAB)))
    official.save_eagle(e3, e3own, tmp_path / "eagle3")
    with pytest.raises(ValueError, match="neither a DFlash drafter .* nor an EAGLE-1 one"):
        official.set_token_order(tmp_path / "eagle3", order)
    with pytest.raises(ValueError, match="a token_order ranks the target's head for EAGLE-1"):
        eagle.check_params(e3, dict(e3own, token_order=jnp.asarray(order)))


def test_dflash_mismatches_name_the_problem(tmp_path):
    import torch

    config, sd = _official_dflash()
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"vocabulary \(64\) differs from the target's \(80\)"):
        official.load_dflash(tmp_path, TARGET.replace(vocab_size=80))
    with pytest.raises(ValueError, match="hidden size 32 differs from the target's 48"):
        official.load_dflash(tmp_path, TARGET.replace(d_model=48))
    with pytest.raises(ValueError, match=r"taps target layers \[1, 3, 4\], the target has "
                                         r"layers 0..3"):
        official.load_dflash(tmp_path, TARGET.replace(n_layers=4))
    no_mask = dict(config, dflash_config={"target_layer_ids": [1, 3, 4]})
    with pytest.raises(ValueError, match="no mask token"):
        official.load_dflash(_variant(tmp_path, no_mask, sd, "nomask"), TARGET)
    narrow = _variant(tmp_path, config, dict(sd, **{"fc.weight": torch.zeros(D, 2 * D)}), "fc")
    with pytest.raises(ValueError, match="fc.weight reads 64 features, not 3 target layers x 32"):
        official.load_dflash(narrow, TARGET)
    missing = _variant(tmp_path, config,
                       {k: v for k, v in sd.items() if k != "layers.1.self_attn.k_norm.weight"},
                       "missing")
    with pytest.raises(ValueError, match="missing tensor layers.1.self_attn.k_norm.weight"):
        official.load_dflash(missing, TARGET)
