#!/usr/bin/python3
"""Train a small torchbnn-style Bayesian MLP in PyTorch and export it for `cfguard import`.

The PyTorch side of "bring your own model": a mean-field Gaussian MLP built from BayesLinear layers
with torchbnn's parameters and semantics, trained briefly with Bayes-by-backprop on a CSV (numeric
feature columns, last column `label` = 0..C-1), its state_dict saved as safetensors.

    /usr/bin/python3 examples/export_torchbnn.py --csv assets/data/breast_cancer.csv --out /tmp/bc.safetensors
    go run ./cmd/cfguard import --weights /tmp/bc.safetensors --classes malignant,benign \\
        --scaler-from assets/data/breast_cancer.csv --out /tmp/bc-model

The network sees standardised features, z = (x - mean) / std with the CSV's per-feature mean and
population standard deviation (a constant feature gets std 1): exactly the scaler that
`cfguard import --scaler-from` fits on the same CSV, so cfguard, given raw features, computes what
this network computes.

--probe FILE also writes the model's Monte-Carlo posterior predictive for a few raw inputs (a few
CSV rows and points near the decision boundary between a row of class 0 and one of class 1):
p_c(x) = mean over S weight draws of softmax(f(x; w_s))_c, with the per-draw variance, so that a
test can compare cfguard's predictive for the imported model with torch's.

Needs Debian's python3-torch and python3-numpy. Debian has no torchbnn or safetensors package, so
BayesLinear is written here (torchbnn's names and initialisation) and the file is written with the
`safetensors` package when it is importable, else with the small writer below.
"""
import argparse
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class BayesLinear(nn.Module):
    """torchbnn's BayesLinear: every weight and bias is an independent Gaussian
    w ~ N(mu, exp(log_sigma)^2), drawn afresh at every forward pass, with prior N(0, prior_sigma^2).
    Initialisation as torchbnn: mu ~ U(-1/sqrt(in), 1/sqrt(in)), log_sigma = log(prior_sigma)."""

    def __init__(self, in_features, out_features, prior_sigma=0.1):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.prior_mu, self.prior_sigma = 0.0, prior_sigma
        self.prior_log_sigma = math.log(prior_sigma)
        stdv = 1.0 / math.sqrt(in_features)
        self.weight_mu = nn.Parameter(torch.empty(out_features, in_features).uniform_(-stdv, stdv))
        self.weight_log_sigma = nn.Parameter(torch.full((out_features, in_features), self.prior_log_sigma))
        self.bias_mu = nn.Parameter(torch.empty(out_features).uniform_(-stdv, stdv))
        self.bias_log_sigma = nn.Parameter(torch.full((out_features,), self.prior_log_sigma))

    def forward(self, x):
        w = self.weight_mu + torch.exp(self.weight_log_sigma) * torch.randn_like(self.weight_log_sigma)
        b = self.bias_mu + torch.exp(self.bias_log_sigma) * torch.randn_like(self.bias_log_sigma)
        return F.linear(x, w, b)

    def kl(self):
        """Sum over parameters of KL(N(mu, sigma^2) || N(0, prior_sigma^2)) and their count."""
        total, n = 0.0, 0
        for mu, ls in ((self.weight_mu, self.weight_log_sigma), (self.bias_mu, self.bias_log_sigma)):
            total = total + (self.prior_log_sigma - ls
                             + (torch.exp(2 * ls) + (mu - self.prior_mu) ** 2) / (2 * self.prior_sigma ** 2) - 0.5).sum()
            n += mu.numel()
        return total, n


class Named(nn.Module):
    """The same network with named layers (keys fc1.weight_mu, ...) instead of nn.Sequential's indices."""

    def __init__(self, d, c, prior_sigma):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = BayesLinear(d, 64, prior_sigma), BayesLinear(64, 32, prior_sigma), BayesLinear(32, c, prior_sigma)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def build(layout, d, c, prior_sigma):
    if layout == "named":
        return Named(d, c, prior_sigma)
    # nn.Sequential: keys 0.weight_mu, 2.weight_mu, 4.weight_mu (the ReLUs hold no tensors).
    return nn.Sequential(BayesLinear(d, 64, prior_sigma), nn.ReLU(), BayesLinear(64, 32, prior_sigma), nn.ReLU(),
                         BayesLinear(32, c, prior_sigma))


def bayes_layers(model):
    """The BayesLinear layers in forward order (registration order for both layouts here)."""
    return [m for m in model.modules() if isinstance(m, BayesLinear)]


def load_csv(path):
    with open(path) as f:
        header = f.readline().strip().split(",")
    if header[-1].strip() != "label":
        sys.exit(f"{path}: last column is {header[-1]!r}, want 'label'")
    data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    return header[:-1], data[:, :-1], data[:, -1].astype(np.int64)


def fit_scaler(X):
    """Per-feature mean and population standard deviation; a constant feature gets std 1
    (bnn.FitScaler's rule, which cfguard import --scaler-from applies)."""
    mean = X.mean(axis=0)
    std = np.sqrt(((X - mean) ** 2).mean(axis=0))
    std[std < 1e-12] = 1.0
    return mean, std


def train(model, z, y, epochs, lr, kl_weight):
    """Bayes-by-backprop: cross-entropy of one weight draw per step + kl_weight x the mean KL to the
    prior over all parameters (torchbnn's BKLLoss with reduction='mean')."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    layers = bayes_layers(model)
    for epoch in range(epochs):
        opt.zero_grad()
        kl, n = 0.0, 0
        for l in layers:
            k, m = l.kl()
            kl, n = kl + k, n + m
        loss = F.cross_entropy(model(z), y) + kl_weight * kl / n
        loss.backward()
        opt.step()
    return float(loss)


def state_dict_tensors(model, dtype):
    return {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}


def write_safetensors(path, tensors):
    """The safetensors format: 8-byte little-endian header length N, N bytes of JSON
    {name: {dtype, shape, data_offsets: [begin, end)}} (padded with spaces to a multiple of 8),
    then the tensors' little-endian bytes back to back."""
    codes = {torch.float32: "F32", torch.float64: "F64"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name]
        raw = t.numpy().astype(t.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def save(path, tensors):
    try:
        from safetensors.torch import save_file
    except ImportError:
        write_safetensors(path, tensors)
        return "the script's writer"
    save_file(tensors, path, metadata={"format": "pt"})
    return "safetensors.torch"


@torch.no_grad()
def mc_predictive(model, z, samples, chunk=500):
    """Monte-Carlo posterior predictive: mean and unbiased variance over `samples` independent
    weight draws of softmax(f(z; w)), each draw shared by all inputs (as cfguard's Predict). Draws
    are batched: W has shape (B, out, in)."""
    layers = bayes_layers(model)
    total = sq = None
    done = 0
    while done < samples:
        b = min(chunk, samples - done)
        h = z.unsqueeze(0).expand(b, -1, -1)
        for k, l in enumerate(layers):
            w = l.weight_mu + torch.exp(l.weight_log_sigma) * torch.randn((b,) + tuple(l.weight_mu.shape), dtype=z.dtype)
            bias = l.bias_mu + torch.exp(l.bias_log_sigma) * torch.randn((b,) + tuple(l.bias_mu.shape), dtype=z.dtype)
            h = torch.bmm(h, w.transpose(1, 2)) + bias.unsqueeze(1)
            if k + 1 < len(layers):
                h = F.relu(h)
        p = F.softmax(h, dim=-1).double()  # (B, N, C)
        total = p.sum(0) if total is None else total + p.sum(0)
        sq = (p ** 2).sum(0) if sq is None else sq + (p ** 2).sum(0)
        done += b
    mean = total / samples
    var = (sq - samples * mean ** 2) / (samples - 1)
    return mean.numpy(), np.maximum(var.numpy(), 0)


def probe_inputs(model, X, y, mean, std, dtype):
    """Two rows of each class, and five points on the segment from the first class-0 row to the
    first class-1 row around where the mean network's p(class 1) crosses 1/2 (bisection), so that
    the probe includes inputs whose predictive is far from 0 and 1."""
    rows = [X[i] for c in (0, 1) for i in np.flatnonzero(y == c)[:2]]
    a, b = X[np.flatnonzero(y == 0)[0]], X[np.flatnonzero(y == 1)[0]]

    def p1(lam):
        z = torch.tensor(((a + lam * (b - a) - mean) / std)[None, :], dtype=dtype)
        h = z
        layers = bayes_layers(model)
        for k, l in enumerate(layers):
            h = F.linear(h, l.weight_mu, l.bias_mu)
            if k + 1 < len(layers):
                h = F.relu(h)
        return float(F.softmax(h, -1)[0, 1])

    lo, hi = 0.0, 1.0
    with torch.no_grad():
        if (p1(lo) - 0.5) * (p1(hi) - 0.5) < 0:
            for _ in range(40):
                mid = (lo + hi) / 2
                if (p1(mid) - 0.5) * (p1(lo) - 0.5) > 0:
                    lo = mid
                else:
                    hi = mid
    star = (lo + hi) / 2
    for d in (-0.02, -0.01, 0.0, 0.01, 0.02):
        lam = min(1.0, max(0.0, star + d))
        rows.append(a + lam * (b - a))
    return np.array(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", required=True, help="training CSV: numeric features, last column label = 0..C-1")
    ap.add_argument("--out", required=True, help="safetensors file to write (the model's state_dict)")
    ap.add_argument("--layout", choices=["sequential", "named"], default="sequential",
                    help="nn.Sequential keys (0.weight_mu, 2.weight_mu, ...) or named layers (fc1.weight_mu, ...)")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--kl-weight", type=float, default=0.01)
    ap.add_argument("--prior-sigma", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--probe", help="also write the Monte-Carlo predictive for a few inputs to this JSON file")
    ap.add_argument("--probe-samples", type=int, default=20000)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    features, X, y = load_csv(args.csv)
    mean, std = fit_scaler(X)
    z = torch.tensor((X - mean) / std, dtype=dtype)
    yt = torch.tensor(y)
    classes = int(y.max()) + 1
    model = build(args.layout, X.shape[1], classes, args.prior_sigma).to(dtype)
    loss = train(model, z, yt, args.epochs, args.lr, args.kl_weight)
    with torch.no_grad():
        pm, _ = mc_predictive(model, z, 200)
    accuracy = float((pm.argmax(1) == y).mean())
    writer = save(args.out, state_dict_tensors(model, dtype))
    summary = {"out": args.out, "layout": args.layout, "dtype": args.dtype, "writer": writer, "rows": len(y),
               "features": len(features), "classes": classes, "loss": loss, "train_accuracy": accuracy,
               "tensors": sorted(model.state_dict())}
    if args.probe:
        xs = probe_inputs(model, X, y, mean, std, dtype)
        p, var = mc_predictive(model, torch.tensor((xs - mean) / std, dtype=dtype), args.probe_samples)
        with open(args.probe, "w") as f:
            json.dump({"inputs": xs.tolist(), "p": p.tolist(), "var": var.tolist(), "samples": args.probe_samples}, f)
        summary["probe"] = args.probe
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
