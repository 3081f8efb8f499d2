"""Every loss against its formula on small hand-checked cases, and gradients where they matter."""
import math

import pytest
import torch

from model import logprobs, losses
from model.optim import build_adamw


def test_sft_token_vs_sample_normalization():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token: (1 + 2 + 3 + 4) / 4 tokens
    assert losses.sft_loss(logp, mask, "token").item() == pytest.approx(2.5)
    # sample: mean(2.0, 4.0)
    assert losses.sft_loss(logp, mask, "sample").item() == pytest.approx(3.0)
    # a row with no counted tokens does not dilute the sample mean
    mask3 = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert losses.sft_loss(logp, mask3, "sample").item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="normalization"):
        losses.sft_loss(logp, mask, "bogus")


def test_logprobs_from_logits_matches_log_softmax_and_ignores():
    logits = torch.tensor([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[2, -100]])
    logp, entropy = logprobs.logprobs_from_logits(logits, labels)
    expect = 3.0 - math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert logp[0, 0].item() == pytest.approx(expect, abs=1e-6)
    assert logp[0, 1].item() == 0.0
    assert entropy[0, 1].item() == pytest.approx(math.log(3), abs=1e-6)


def test_dpo_loss_formula_and_gradient_sign():
    pc = torch.tensor([-1.0, -2.0], requires_grad=True)
    pr = torch.tensor([-3.0, -1.0], requires_grad=True)
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -1.5])
    beta = 0.5
    loss, stats = losses.dpo_loss(pc, pr, rc, rr, beta)
    m = [beta * ((-1 + 1.5) - (-3 + 2.5)), beta * ((-2 + 2) - (-1 + 1.5))]
    expect = sum(-math.log(1 / (1 + math.exp(-x))) for x in m) / 2
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert stats["reward_accuracy"] == 0.5
    loss.backward()
    # raising the chosen log-prob lowers the loss; raising the rejected one raises it
    assert (pc.grad < 0).all() and (pr.grad > 0).all()


def test_group_advantages_normalize_within_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = losses.group_advantages(rewards, group_size=3)
    g1 = torch.tensor([1.0, 0.0, 0.0])
    expect = (g1 - g1.mean()) / g1.std(unbiased=False)
    assert torch.allclose(adv[:3], expect, atol=1e-5)
    assert torch.equal(adv[3:], torch.zeros(3))  # all-equal group: no signal
    assert losses.informative_groups(rewards, 3).tolist() == [True, False]
    with pytest.raises(ValueError, match="groups of 4"):
        losses.group_advantages(rewards, 4)


def _policy_case():
    # one group of two responses, three positions; row 1 has two tokens
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0], [-0.2, -1.2, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, old, adv, mask


def test_cispo_value_matches_eq4():
    logp, old, adv, mask = _policy_case()
    eps_low, eps_high = 1.0, 0.2
    loss, stats = losses.cispo_loss(logp, old, adv, mask, eps_low, eps_high, group_size=2)
    r = torch.exp(logp.detach() - old)
    w = r.clamp(1 - eps_low, 1 + eps_high)
    a = adv[:, None].expand_as(logp)
    expect = -(w * a * logp.detach() * mask).sum() / mask.sum()  # 1 / sum_i |o_i|
    assert loss.item() == pytest.approx(expect.item(), abs=1e-6)
    # ratio of token (0, 1) is e^0.5 > 1.2: one of five tokens is clipped
    assert stats["clip_fraction"] == pytest.approx(1 / 5)


def test_cispo_normalizes_each_group_by_its_own_token_count():
    logp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0], [-1.0, 0.0], [-3.0, 0.0]])
    old = logp.clone()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0], [1, 0]])
    loss, _ = losses.cispo_loss(logp, old, adv, mask, group_size=2)
    group1 = -((-1 - 1) * 1 + (-2) * -1) / 3
    group2 = -((-1) * 1 + (-3) * -1) / 2
    assert loss.item() == pytest.approx((group1 + group2) / 2)


def test_cispo_keeps_gradient_on_clipped_tokens_grpo_does_not():
    # token 0: ratio e^0.5 ~ 1.65, far above 1 + eps with a positive advantage
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    eps = 0.2

    grpo, _ = losses.grpo_loss(logp, old, adv, mask, eps_low=eps, eps_high=eps)
    (g_grpo,) = torch.autograd.grad(grpo, logp)
    assert g_grpo[0, 0].item() == 0.0          # PPO clip: no gradient through the clipped token
    assert g_grpo[0, 1].item() != 0.0

    cispo, _ = losses.cispo_loss(logp, old, adv, mask, eps_low=1.0, eps_high=eps)
    (g_cispo,) = torch.autograd.grad(cispo, logp)
    # d/dlogp of -(sg(clip r) * A * logp) / N = -(1 + eps) * A / N on the clipped token
    assert g_cispo[0, 0].item() == pytest.approx(-(1 + eps) / 2)
    assert g_cispo[0, 1].item() == pytest.approx(-1.0 / 2)


def test_cispo_mask_variant_is_eq7():
    logp, old, adv, mask = _policy_case()
    loss, _ = losses.cispo_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.2, group_size=2, variant="mask")
    r = torch.exp(logp.detach() - old)
    a = adv[:, None].expand_as(logp)
    keep = ~(((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.9)))
    expect = -(r * a * logp.detach() * mask * keep).sum() / mask.sum()
    assert loss.item() == pytest.approx(expect.item(), abs=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 1].item() == 0.0     # masked: A > 0 and r = e^0.5 > 1.2
    assert g[0, 0].item() != 0.0


def test_grpo_is_mean_of_response_means():
    logp, old, adv, mask = _policy_case()
    loss, _ = losses.grpo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    r = torch.exp(logp.detach() - old)
    a = adv[:, None].expand_as(logp)
    obj = torch.minimum(r * a, r.clamp(0.8, 1.2) * a) * mask
    expect = -((obj[0].sum() / 3) + (obj[1].sum() / 2)) / 2
    assert loss.item() == pytest.approx(expect.item(), abs=1e-6)


def test_grpo_clips_below_at_eps_low_and_above_at_eps_high():
    """A length window lowers eps_high only: GRPO's lower bound stays eps_low (it moved with eps_high)."""
    # A < 0 on ratios e^-0.25 ~ 0.78 and e^-0.1 ~ 0.90: PPO clips a ratio below 1 - eps_low
    logp = torch.tensor([[-1.25, -1.1, -0.9]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 3)
    loss, stats = losses.policy_loss("grpo", logp, old, adv, mask, eps_low=0.3, eps_high=0.05)
    r = torch.exp(logp.detach() - old)
    obj = torch.minimum(-r, -r.clamp(0.7, 1.05))
    assert loss.item() == pytest.approx(-obj.mean().item(), abs=1e-6)
    (g,) = torch.autograd.grad(loss, logp)
    # both ratios below 1 stay inside [0.7, 1.05] and keep their gradient; 1 + eps_high caps
    # nothing here (A < 0 takes the min on the unclipped side above 1)
    assert g[0, 0].item() != 0.0 and g[0, 1].item() != 0.0
    assert stats["clip_fraction"] == pytest.approx(1 / 3)   # only e^0.1 ~ 1.105 > 1.05
    # with eps_low 0.15 the first token (0.78 < 0.85) is clipped: no gradient
    loss, stats = losses.policy_loss("grpo", logp, old, adv, mask, eps_low=0.15, eps_high=0.05)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 0].item() == 0.0 and g[0, 1].item() != 0.0
    assert stats["clip_fraction"] == pytest.approx(2 / 3)


def test_dapo_clip_higher_token_mean():
    logp, old, adv, mask = _policy_case()
    loss, _ = losses.dapo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    r = torch.exp(logp.detach() - old)
    a = adv[:, None].expand_as(logp)
    obj = torch.minimum(r * a, r.clamp(0.8, 1.28) * a) * mask
    assert loss.item() == pytest.approx((-obj.sum() / mask.sum()).item(), abs=1e-6)
    with pytest.raises(ValueError, match="unknown policy loss"):
        losses.policy_loss("ppo2", logp, old, adv, mask, 0.2, 0.2)


def test_on_policy_cispo_gradient_equals_reinforce():
    # at r = 1 the CISPO gradient is the token-normalized policy gradient A * grad log pi
    logp = torch.tensor([[-0.7, -1.1], [-0.2, -0.9]], requires_grad=True)
    adv = torch.tensor([0.5, -0.5])
    loss, _ = losses.cispo_loss(logp, logp.detach(), adv, torch.ones(2, 2), group_size=2)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, -adv[:, None].expand(2, 2) / 4)


def test_build_adamw_defaults_are_m1():
    opt = build_adamw([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    group = opt.param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-15


def test_token_logprobs_fused_path_matches_logits_path():
    import tempfile

    from model import build_tiny_model
    from model.tokenizer import train_tokenizer
    with tempfile.TemporaryDirectory() as d:
        tok = train_tokenizer(["the answer is 42 and 7"] * 20, 300, d)
    model = build_tiny_model(tok, {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                   "num_attention_heads": 2, "num_key_value_heads": 1,
                                   "softmax_attention_every": 2})
    ids = torch.randint(0, len(tok), (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    fused, ent, _ = logprobs.token_logprobs(model, ids, mask)
    logits = model(input_ids=ids, attention_mask=mask).logits
    ref, ref_ent = logprobs.logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    assert torch.allclose(fused, ref, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-4)


def _reference_policy_loss(name, logp, old, adv, mask, eps_low, eps_high, group_size, how):
    """The policy objectives written out token by token in plain Python floats (no tensors), as
    the papers state them: CISPO's sg(clip(r)) * A * log pi, PPO-clip's min(r A, clip(r) A), then
    reduced by ``how`` over the counted tokens. Returns the loss (minimized)."""
    rows = len(logp)
    terms = [[0.0] * len(logp[i]) for i in range(rows)]
    for i in range(rows):
        for t in range(len(logp[i])):
            r = math.exp(logp[i][t] - old[i][t])
            if name == "cispo":
                terms[i][t] = min(max(r, 1 - eps_low), 1 + eps_high) * adv[i] * logp[i][t]
            else:
                terms[i][t] = min(r * adv[i], min(max(r, 1 - eps_low), 1 + eps_high) * adv[i])
    counted = [[t for t in range(len(mask[i])) if mask[i][t]] for i in range(rows)]
    if how == "batch_token":
        total = sum(terms[i][t] for i in range(rows) for t in counted[i])
        return -total / sum(len(c) for c in counted)
    if how == "sample":
        means = [sum(terms[i][t] for t in counted[i]) / len(counted[i]) for i in range(rows) if counted[i]]
        return -sum(means) / len(means)
    group_losses = []
    for g in range(0, rows, group_size):
        members = range(g, g + group_size)
        tokens = sum(len(counted[i]) for i in members)
        group_losses.append(sum(terms[i][t] for i in members for t in counted[i]) / tokens)
    return -sum(group_losses) / len(group_losses)


@pytest.mark.parametrize("how", ["group_token", "sample", "batch_token"])
@pytest.mark.parametrize("name", ["cispo", "grpo", "dapo"])
def test_every_policy_loss_under_every_normalization_matches_the_written_out_formula(name, how):
    """RL's normalization setting (``rl.normalization``, ``agent.normalization``) on each policy
    loss: the value equals the token-by-token reference above, and so does the gradient (the
    reference's, by central differences on each counted token, CISPO's weight held fixed)."""
    g = torch.Generator().manual_seed(7)
    rows, width, group_size = 6, 5, 3
    logp = (-torch.rand(rows, width, generator=g) * 2).double()
    old = logp + (torch.rand(rows, width, generator=g).double() - 0.5) * 0.8
    adv = torch.tensor([1.0, -0.5, -0.5, 0.8, 0.2, -1.0], dtype=torch.float64)
    lengths = [5, 2, 4, 1, 3, 5]    # uneven lengths: the normalizations differ
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.float64)
    eps_low, eps_high = (1.0, 0.2) if name == "cispo" else (0.2, 0.28)
    x = logp.clone().requires_grad_(True)
    loss, _ = losses.policy_loss(name, x, old, adv, mask, eps_low, eps_high, group_size=group_size,
                                 normalization=how)
    args = (old.tolist(), adv.tolist(), mask.tolist(), eps_low, eps_high, group_size, how)
    assert loss.item() == pytest.approx(_reference_policy_loss(name, logp.tolist(), *args), abs=1e-12)
    (grad,) = torch.autograd.grad(loss, x)
    h = 1e-6
    for i, n in enumerate(lengths):
        for t in range(n):
            up, down = logp.tolist(), logp.tolist()
            up[i][t] += h
            down[i][t] -= h
            if name == "cispo":   # sg(weight): the reference's weight stays at the sampled ratio
                old_up, old_down = old.tolist(), old.tolist()
                old_up[i][t] += h
                old_down[i][t] -= h
                numeric = (_reference_policy_loss(name, up, old_up, *args[1:])
                           - _reference_policy_loss(name, down, old_down, *args[1:])) / (2 * h)
            else:
                numeric = (_reference_policy_loss(name, up, *args) - _reference_policy_loss(name, down, *args)) / (2 * h)
            assert grad[i, t].item() == pytest.approx(numeric, abs=1e-6), (i, t)
    assert torch.all(grad[mask == 0] == 0)
    if how != losses.DEFAULT_NORMALIZATION[name]:   # a setting that changes the loss
        own, _ = losses.policy_loss(name, logp, old, adv, mask, eps_low, eps_high, group_size=group_size)
        assert own.item() != pytest.approx(loss.item(), abs=1e-9)
