"""The classic NaN/Inf causes PyTorch users hit, each as a tiny seeded model and the training
loop a user writes, in full and sentinel mode (and with backward=True where the NaN is a
gradient's): the diagnosis leads with the fix known for that cause, at the user's line, and
torch's own safe forms (BCELoss, F.normalize, torch.norm, the double where) raise nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwidget as nw

MODES = ["full", "sentinel"]


def watch(model: nn.Module, mode: str, **options) -> nw.NanWatch:
    if mode == "sentinel":
        options["mode"] = "sentinel"
    return nw.watch(model, on_nan="record", **options)


def train(model: nn.Module, w: nw.NanWatch, batches: list, loss_of=None, lr: float = 0.01) -> None:
    """A user's loop: forward, loss, backward, step, until the watch records an event."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        out = model(*batch)
        loss = loss_of(out) if loss_of is not None else out.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if w.events:
            return


# ------------------------------------------------------------- log of probabilities by hand
class LogSoftmaxByHand(nn.Module):
    """Log-probabilities as log(softmax(logits)): a probability that underflows gives -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.fc(x) * 30
        return torch.log(torch.softmax(logits, dim=-1))


@pytest.mark.parametrize("mode", MODES)
def test_log_of_softmax_of_logits_leads_with_log_softmax_not_a_flows_squeeze(mode):
    # A variable named `logits` on the line read as a logit transform: the first fix was
    # RealNVP's alpha squeeze of data in [0, 1].
    torch.manual_seed(0)
    model = LogSoftmaxByHand()
    x, y = torch.randn(6, 8) * 3, torch.randint(0, 5, (6,))
    with watch(model, mode) as w:
        train(model, w, [(x,)] * 2, lambda out: -(F.one_hot(y, 5) * out).sum(-1).mean())
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain" and "log of values down to 0" in diagnosis.summary
    first = diagnosis.suggestion[0]
    assert "F.log_softmax(logits, dim)" in first and "test_classic_causes.py:" in first
    said = " ".join(diagnosis.suggestion)
    assert "Squeeze" not in said and "RealNVP" not in said


class BinaryCrossEntropyByHand(nn.Module):
    """A binary cross-entropy written out, on a sigmoid that saturates to exactly 1.0."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.fc(x) * 40)
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


@pytest.mark.parametrize("mode", MODES)
def test_bce_by_hand_leads_with_bce_with_logits_not_a_logit_transform(mode):
    # log(p) ... log(1 - p) on one line was read as a flow's logit transform.
    torch.manual_seed(0)
    model = BinaryCrossEntropyByHand()
    x, y = torch.randn(6, 8) * 3, (torch.rand(6, 1) > 0.5).float()
    with watch(model, mode) as w:
        train(model, w, [(x, y)] * 2, lambda loss: loss)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "domain"
    assert "binary_cross_entropy_with_logits" in diagnosis.suggestion[0]
    assert "Squeeze" not in " ".join(diagnosis.suggestion)


class SigmoidHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x) * 40)


@pytest.mark.parametrize("mode", MODES)
def test_bce_loss_on_a_saturated_sigmoid_is_no_event(mode):
    # nn.BCELoss clamps its log at -100: outputs of exactly 1.0 train on, finite.
    torch.manual_seed(0)
    model = SigmoidHead()
    x, y = torch.randn(6, 8) * 3, (torch.rand(6, 1) > 0.5).float()
    assert (model(x) == 1).any()
    with watch(model, mode, backward=True) as w:
        train(model, w, [(x,)] * 3, lambda p: nn.BCELoss()(p, y))
    assert w.event is None


# ------------------------------------------------------------- a softmax by hand in float16
class SoftmaxByHand(nn.Module):
    """exp(s) / sum without subtracting the max, in float16 (exp passes 65504 above 11.1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 6), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc(x).half() * 8
        e = torch.exp(s)
        p = e / e.sum(-1, keepdim=True)
        return self.out(p.float())


@pytest.mark.parametrize("mode", MODES)
def test_exp_of_scores_in_a_softmax_by_hand_leads_with_subtracting_the_max(mode):
    # exp(s) read as a flow's predicted log-scale: the first fix was the tanh soft clamp,
    # and the stable-form fix (subtract the max) was dropped.
    torch.manual_seed(0)
    model = SoftmaxByHand()
    with watch(model, mode) as w:
        train(model, w, [(torch.randn(4, 8),), (torch.randn(4, 8) * 4,)])
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "overflow" and "exp of values up to" in diagnosis.summary
    assert "x.amax(dim, keepdim=True)" in diagnosis.suggestion[0]
    assert "torch.tanh(s / c)" not in " ".join(diagnosis.suggestion)


# ------------------------------------------------------- sqrt / pow(0.5) at 0 in a gradient
class Triplet(nn.Module):
    """A triplet loss on Euclidean distances written with sqrt or pow(0.5): a positive that
    is its anchor has distance 0, where the root's slope is infinite."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.fc, self.root = nn.Linear(8, 4), root

    def forward(self, a: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        ea, ep, en = self.fc(a), self.fc(p), self.fc(n)
        if self.root == "sqrt":
            dp, dn = ((ea - ep) ** 2).sum(-1).sqrt(), ((ea - en) ** 2).sum(-1).sqrt()
        elif self.root == "pow":
            dp, dn = ((ea - ep) ** 2).sum(-1).pow(0.5), ((ea - en) ** 2).sum(-1).pow(0.5)
        elif self.root == "norm":
            dp, dn = torch.norm(ea - ep, dim=-1), torch.norm(ea - en, dim=-1)
        else:  # F.normalize divides by max(norm, eps)
            dp = (F.normalize(ea - ep, dim=-1) * ea).sum(-1)
            dn = (F.normalize(ea - en, dim=-1) * en).sum(-1)
        return torch.relu(dp - dn + 1.0).mean()


def triplets() -> list:
    torch.manual_seed(0)
    a, p, n = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    duplicate = p.clone()
    duplicate[1] = a[1]  # sample 1's positive is its anchor
    return [(a, p, n), (a, duplicate, n), (a, p, n)]


@pytest.mark.parametrize("mode", MODES)
def test_sqrt_at_0_in_a_triplet_loss_leads_with_an_eps_not_the_where_guard(mode):
    # The line has no torch.where, yet the first fix was "Guard the argument of sqrt, not its
    # result: torch.where(mask, torch.sqrt(x), 0) ...".
    batches = triplets()
    torch.manual_seed(0)
    model = Triplet("sqrt")
    with watch(model, mode, backward=True) as w:
        train(model, w, batches, lambda loss: loss)
    event, diagnosis = w.event, w.event.diagnosis
    assert event.batch == 1 and event.is_backward and diagnosis.kind == "domain"
    assert "the gradient of sqrt is infinite" in diagnosis.summary
    assert "relu or hinge" in diagnosis.summary
    assert "torch.sqrt(x + eps)" in diagnosis.suggestion[0]
    assert "test_classic_causes.py:" in diagnosis.suggestion[0]
    assert diagnosis.suggestion[-1].startswith("If a mask or torch.where drops the value")


@pytest.mark.parametrize("mode", MODES)
def test_pow_half_at_0_in_a_gradient_leads_with_its_slope_not_a_graphs_degree(mode):
    # The first fixes were a negative base and GCN's deg.pow(-0.5); the gradient's came last.
    batches = triplets()
    torch.manual_seed(0)
    model = Triplet("pow")
    with watch(model, mode, backward=True) as w:
        train(model, w, batches, lambda loss: loss)
    diagnosis = w.event.diagnosis
    assert w.event.is_backward and diagnosis.kind == "domain"
    assert "the gradient of pow is infinite" in diagnosis.summary
    first = diagnosis.suggestion[0]
    assert "(x + eps).pow(p)" in first and "vector_norm" in first


@pytest.mark.parametrize("root", ["norm", "normalize"])
def test_torch_norm_and_normalize_at_0_are_no_event(root):
    # torch.norm's gradient at 0 is 0 and F.normalize divides by max(norm, eps): no false alarm.
    batches = triplets()
    torch.manual_seed(0)
    model = Triplet(root)
    with watch(model, "full", backward=True) as w:
        train(model, w, batches, lambda loss: loss)
    assert w.event is None


# ------------------------------------------------------- where(mask, log(x), 0): the trap
class MaskedEntropy(nn.Module):
    """The entropy of a masked distribution, with its log(0) dropped by torch.where."""

    def __init__(self, double_where: bool) -> None:
        super().__init__()
        self.fc, self.out, self.double_where = nn.Linear(8, 6), nn.Linear(6, 1), double_where
        self.register_buffer("mask", torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(self.fc(x), -1) * self.mask
        if self.double_where:
            h = -p * torch.where(p > 0, torch.where(p > 0, p, 1.0).log(), 0.0)
        else:
            h = -p * torch.where(p > 0, p.log(), 0.0)
        return self.out(h)


@pytest.mark.parametrize("mode", MODES)
def test_where_of_a_log_keeps_the_double_where_first_and_the_double_where_is_quiet(mode):
    # (it was right before: the where guard must stay first where the line has a where)
    torch.manual_seed(0)
    model = MaskedEntropy(double_where=False)
    batches = [(torch.randn(4, 8),) for _ in range(2)]
    with watch(model, mode, backward=True) as w:
        train(model, w, batches)
    diagnosis = w.event.diagnosis
    assert w.event.batch == 0 and w.event.is_backward and diagnosis.kind == "domain"
    assert "torch.log(torch.where(mask, x, 1))" in diagnosis.suggestion[0]
    torch.manual_seed(0)
    model = MaskedEntropy(double_where=True)
    with watch(model, mode, backward=True) as w:
        train(model, w, batches)
    assert w.event is None


# ------------------------------------------------------- std over one sample
class StdOverTheBatch(nn.Module):
    """A normalisation by hand over the batch's dimension (unbiased std: n - 1 = 0 at n = 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.out((h - h.mean(0)) / torch.std(h, dim=0))


@pytest.mark.filterwarnings("ignore:std\\(\\)")
@pytest.mark.parametrize("mode", MODES)
def test_std_over_a_last_batch_of_one_sample_says_correction_0_and_drop_last(mode):
    torch.manual_seed(0)
    model = StdOverTheBatch()
    batches = [(torch.randn(4, 8),), (torch.randn(4, 8),), (torch.randn(1, 8),)]
    with watch(model, mode) as w:
        train(model, w, batches)
    diagnosis = w.event.diagnosis
    assert w.event.batch == 2 and diagnosis.kind == "domain"
    assert "std over a single element" in diagnosis.summary
    assert "correction=0 (unbiased=False)" in diagnosis.suggestion[0]
    assert any("drop_last=True" in line for line in diagnosis.suggestion)


# ------------------------------------------------------- a VAE's log-variance
class VAE(nn.Module):
    """A VAE's reparameterisation: std = exp(0.5 * log_var) overflows once log_var runs away."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 4), nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, log_var = self.enc(x).chunk(2, -1)
        std = torch.exp(0.5 * log_var)
        return self.dec(mu + std * torch.randn_like(std)), mu, log_var


def test_a_vae_diverging_into_exp_of_its_log_var_is_told_to_clamp_log_var_too():
    # Full mode tells the divergence (lr, clipping) and did not say to bound log_var, which
    # sentinel mode's overflow leads with.
    torch.manual_seed(0)
    model = VAE()
    x = torch.randn(4, 8) * 3

    def elbo(out):
        recon, mu, log_var = out
        kl = -0.5 * (1 + log_var - mu ** 2 - log_var.exp()).sum(-1).mean()
        return F.mse_loss(recon, x) + kl

    with watch(model, "full") as w:
        train(model, w, [(x,)] * 10, elbo, lr=0.1)
    diagnosis = w.event.diagnosis
    assert diagnosis.kind == "divergence" and "until exp in module" in diagnosis.summary
    assert diagnosis.suggestion[0].startswith("Lower the learning rate")
    assert "log_var.clamp(-10, 10)" in " ".join(diagnosis.suggestion[:3])
