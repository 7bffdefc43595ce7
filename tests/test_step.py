"""The learner's inner step: the shipped forward pass computes what the previous one did
(`ops.bench.step` keeps the previous one as its baseline), and the step's FLOP count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ops.bench.step import _reference_forward, step_flops
from pipeline import model
from pipeline.config import ModelConfig


@pytest.mark.parametrize("shape", [dict(d_model=32, n_layers=2, n_heads=4, seq_len=16),
                                   dict(d_model=24, n_layers=1, n_heads=3, seq_len=9)])
def test_the_shipped_forward_and_its_gradient_equal_the_previous_ones(shape):
    cfg = ModelConfig(**shape)
    params = model.init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, cfg.seq_len), 0, cfg.vocab_size)
    # one compiled function per forward, the logits and the gradient of their mean square
    # (op by op, the two passes and their gradients took ~16 s per shape)
    def logits_and_grad(fwd):
        def f(p, toks):
            y, vjp = jax.vjp(lambda q: fwd(q, toks, cfg), p)
            return y, vjp(2 * y / y.size)[0]  # d mean(y²) / dp
        return jax.jit(f)

    shipped = logits_and_grad(model.forward)
    (new, g_new), (old, g_old) = shipped(params, tokens), logits_and_grad(_reference_forward)(
        params, tokens)
    assert new.shape == old.shape == (3, cfg.seq_len, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(new), np.asarray(old), rtol=1e-5, atol=1e-5)
    # causal: the logits of position i do not depend on tokens after i
    later = tokens.at[:, -1].set((tokens[:, -1] + 1) % cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(shipped(params, later)[0])[:, :-1],
                                  np.asarray(new)[:, :-1])
    for k in params:
        np.testing.assert_allclose(np.asarray(g_new[k]), np.asarray(g_old[k]), rtol=1e-4,
                                   atol=1e-6, err_msg=k)


def test_step_flops_counts_six_per_parameter_and_token_plus_attention():
    assert step_flops(128, 4, 128, 1000, 10) == 6 * 1000 * 10 + 12 * 4 * 128 * 128 * 10


def test_the_pytorch_reference_is_the_same_model_with_the_same_gradients():
    """`diloco bench step` times a PyTorch twin of the model: it must compute the JAX model's
    loss and gradients from the same parameters, or the comparison compares nothing."""
    pytest.importorskip("torch")
    from ops.bench import step_torch

    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16)
    params = {k: np.asarray(v) for k, v in model.init_params(cfg, 0).items()}
    batch = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (3, cfg.seq_len + 1), 0,
                                          cfg.vocab_size), np.int32)
    (j_loss, j_acc), j_grads = jax.value_and_grad(model.loss_and_accuracy, has_aux=True)(
        params, jnp.asarray(batch), cfg)
    assert step_torch.check_same_model(params, batch, cfg, float(j_loss)) == pytest.approx(
        float(j_loss), rel=1e-5)
    tp = step_torch.to_torch(params)
    t_loss, t_acc = step_torch._loss_and_accuracy(tp, step_torch._tokens(batch), cfg)
    t_loss.backward()
    assert float(t_acc) == pytest.approx(float(j_acc))
    for k in params:
        np.testing.assert_allclose(tp[k].grad.numpy(), np.asarray(j_grads[k]), rtol=1e-4,
                                   atol=1e-6, err_msg=k)
    # a different model is refused before anything is timed
    with pytest.raises(AssertionError, match="not the same model"):
        step_torch.check_same_model(params, batch, cfg, float(j_loss) + 0.01)


def test_the_benchmark_records_why_the_pytorch_reference_did_not_run(monkeypatch):
    import sys

    from ops.bench import step_torch

    monkeypatch.setitem(sys.modules, "torch", None)  # what an absent torch looks like
    assert "torch is not installed" in step_torch.available()


def test_the_curve_cost_measure_sends_whole_messages_both_ways():
    """`curve_cost` (part of `diloco bench security`) times real PUB/SUB sockets, plain and
    with CURVE; each timed message must arrive whole."""
    from ops.bench.pipeline import curve_cost

    out = curve_cost(size=256 * 1024, n=3)
    assert out["message_bytes"] == 256 * 1024 and out["messages"] == 3
    assert len(out["runs"]["plain"]) == len(out["runs"]["curve"]) == 2
    assert all(t > 0 for ts in out["runs"].values() for t in ts)
    assert out["curve_ms_added"] == out["ms_curve"] - out["ms_plain"]
