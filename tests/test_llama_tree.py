"""The Llama-style decoder (pipeline/llama.py) and parameter trees by name (pipeline/tree.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from broker import codec
from pipeline import data, llama, quant, tree
from pipeline.config import DataConfig

CFG = llama.LlamaConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, ffn_dim=64,
                        seq_len=32)


# ---------------------------------------------------------------------------------- names


def test_names_are_paths_in_a_stable_order():
    params = llama.init_params(CFG, 0)
    names = list(tree.flatten(params))
    assert names[:2] == ["embed", "final_norm"]  # dict keys sorted, as JAX flattens them
    assert "layers/1/attn/wq" in names and "layers/0/mlp/w_down" in names
    assert names == list(tree.flatten(llama.init_params(CFG, 1)))
    assert len(names) == 3 + 9 * CFG.n_layers  # embed, final_norm, head; 9 per layer


def test_unflatten_inverts_flatten_and_checks_names():
    params = llama.init_params(CFG, 0)
    flat = tree.flatten(params)
    back = tree.unflatten(flat, params)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(back),
                                      jax.tree_util.tree_leaves(params), strict=True))
    with pytest.raises(ValueError, match="not in the parameter tree"):
        tree.unflatten({**flat, "extra": flat["embed"]}, params)
    with pytest.raises(KeyError):
        tree.unflatten({k: v for k, v in flat.items() if k != "head"}, params)


@pytest.mark.parametrize("bad", [{"a/b": 1.0}, {"": 1.0}, {1: 1.0}], ids=["slash", "empty", "int"])
def test_keys_that_would_make_names_ambiguous_are_refused(bad):
    with pytest.raises(ValueError):
        tree.flatten({"x": bad})


def test_a_nested_tree_crosses_the_wire_bit_for_bit():
    params = llama.init_params(CFG, 3)
    flat = {k: np.asarray(v) for k, v in tree.flatten(params).items()}
    blob = codec.pack_tensors({k: quant.quantize(v, "fp32") for k, v in flat.items()})
    got = {k: quant.dequantize(q) for k, q in codec.unpack_tensors(blob).items()}
    assert list(got) == list(flat)
    back = tree.unflatten(got, params)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params),
                    strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


# ---------------------------------------------------------------------------------- model


def test_logits_shape_and_causality():
    params = llama.init_params(CFG, 0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, CFG.seq_len)), jnp.int32)
    forward = jax.jit(llama.forward, static_argnums=2)  # one compile, not one per operation
    logits = forward(params, tokens, CFG)
    assert logits.shape == (2, CFG.seq_len, CFG.vocab_size)
    changed = tokens.at[:, 20:].set((tokens[:, 20:] + 1) % 256)
    later = forward(params, changed, CFG)
    np.testing.assert_allclose(logits[:, :20], later[:, :20], rtol=1e-5, atol=1e-6)
    assert not np.allclose(logits[:, 20:], later[:, 20:])


def test_rotary_keeps_norms_and_scores_depend_on_the_offset_only():
    rng = np.random.default_rng(1)
    q1, k1 = (rng.standard_normal((1, 1, 1, 8)).astype(np.float32) for _ in range(2))
    x = jnp.asarray(np.repeat(np.concatenate([q1, k1], axis=2), 12, axis=1))  # [1, 12, 2, 8]
    r = llama.rotary(x, 10_000.0)
    np.testing.assert_allclose(jnp.linalg.norm(r, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)
    score = lambda i, j: float(jnp.dot(r[0, i, 0], r[0, j, 1]))  # noqa: E731
    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-4)   # both offset 3
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_a_wider_vocabulary_and_an_untied_head():
    cfg = llama.LlamaConfig(vocab_size=1000, d_model=16, n_layers=1, n_heads=2, ffn_dim=32,
                            seq_len=8)
    params = llama.init_params(cfg, 0)
    assert params["embed"].shape == (1000, 16) and params["head"].shape == (16, 1000)
    loss, _ = jax.jit(llama.loss_and_accuracy, static_argnums=2)(
        params, jnp.zeros((1, 9), jnp.int32), cfg)
    assert float(loss) == pytest.approx(np.log(1000), rel=0.05)  # near uniform at init


@pytest.mark.parametrize("bad", [dict(d_model=30, n_heads=4), dict(d_model=12, n_heads=4),
                                 dict(n_layers=0)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        llama.LlamaConfig(**bad)


def test_adamw_lowers_the_loss_on_text():
    corpus = data.make_corpus(data.load_tokens(DataConfig(max_bytes=300_000)), 1,
                              CFG.seq_len, 0.05, 0)
    params = llama.init_params(CFG, 0)
    opt = optax.adamw(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        (loss, _), grads = jax.value_and_grad(llama.loss_and_accuracy, has_aux=True)(
            params, batch, CFG)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    evals = corpus.eval_batches(2, 8)
    evaluate = jax.jit(llama.loss_and_accuracy, static_argnums=2)
    before = np.mean([float(evaluate(params, jnp.asarray(b), CFG)[0]) for b in evals])
    for t in range(60):
        params, state, _ = step(params, state, jnp.asarray(corpus.batch(0, t, 8)))
    after = np.mean([float(evaluate(params, jnp.asarray(b), CFG)[0]) for b in evals])
    assert after < 0.8 * before, (before, after)
