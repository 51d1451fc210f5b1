#!/usr/bin/python3
"""Time the PyTorch side of vstorch: the workloads cfguard benchmarks, written the way the paper's
stack runs them (torchbnn's Bayesian layers), so that the two can be compared on one core.

vstorch embeds this file, writes it to a temporary directory and runs it pinned to a core:

    taskset -c 0 python3 torch_bench.py predict --dtype 64 --reps 3
    taskset -c 0 python3 torch_bench.py update --data breast_cancer.csv --reps 5
    taskset -c 0 python3 torch_bench.py train --data breast_cancer.csv --epochs 300 --reps 1

Workloads (torch.set_num_threads(1), torch.manual_seed(1)):

  predict  the Monte-Carlo predictive of class 1: --inputs standard-normal inputs (10,000) through
           --samples weight draws (100) of a fresh 30 -> H -> H/2 -> 2 ReLU network (H = --hidden,
           64), softmax per draw, then the mean and variance over the draws.
  update   64 records (the first rows of --data), a copy of a fixed network with its first two
           layers frozen, 50 Adam steps (lr 1e-5) on the last layer's objective
           cross-entropy + 0.1 / 64 * KL(last layer || prior), then KL(q_new || q_prev) in
           closed form.
  train    Bayes-by-backprop on all of --data for --epochs epochs (300), shuffled minibatches of
           64, Adam lr 0.01, objective cross-entropy + 0.1 * the mean KL to the prior.

--data is a CSV file with a header row, numeric features and the integer label last; the features
are standardised with the whole file's mean and (population) standard deviation. Each workload is
run once untimed, then --reps times; the script prints one JSON line:

    {"what": ..., "dtype": "float64", "reps": N, "median_s": ..., "min_s": ..., ...}

The layers follow torchbnn's BayesLinear: mu ~ U(-1/sqrt(in), 1/sqrt(in)), log sigma starts at
log(prior_sigma) with prior_sigma 0.1, a fresh weight draw at every forward pass, and the KL of
each weight and bias to N(0, prior_sigma^2).
"""
import argparse
import copy
import json
import math
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

PRIOR_SIGMA = 0.1


class Bayesian(torch.nn.Module):
    """A fully connected layer with a factorised Gaussian posterior over its weights and biases."""

    def __init__(self, n_in, n_out, dtype):
        super().__init__()
        bound = 1.0 / math.sqrt(n_in)
        log_sigma = math.log(PRIOR_SIGMA)
        self.w_mu = torch.nn.Parameter(torch.empty(n_out, n_in, dtype=dtype).uniform_(-bound, bound))
        self.w_log_sigma = torch.nn.Parameter(torch.full((n_out, n_in), log_sigma, dtype=dtype))
        self.b_mu = torch.nn.Parameter(torch.empty(n_out, dtype=dtype).uniform_(-bound, bound))
        self.b_log_sigma = torch.nn.Parameter(torch.full((n_out,), log_sigma, dtype=dtype))

    def forward(self, x):
        w = self.w_mu + self.w_log_sigma.exp() * torch.randn_like(self.w_mu)
        b = self.b_mu + self.b_log_sigma.exp() * torch.randn_like(self.b_mu)
        return F.linear(x, w, b)

    def prior_kl(self):
        """Sum of KL(N(mu, sigma^2) || N(0, PRIOR_SIGMA^2)) over the parameters, and their count."""
        total, count = 0.0, 0
        for mu, log_sigma in ((self.w_mu, self.w_log_sigma), (self.b_mu, self.b_log_sigma)):
            kl = (math.log(PRIOR_SIGMA) - log_sigma
                  + ((2 * log_sigma).exp() + mu * mu) / (2 * PRIOR_SIGMA ** 2) - 0.5)
            total = total + kl.sum()
            count += mu.numel()
        return total, count

    def moments(self):
        """The posterior's means and variances, flattened, in float64."""
        mu = torch.cat([self.w_mu.detach().flatten(), self.b_mu.detach().flatten()])
        var = torch.cat([(2 * self.w_log_sigma.detach()).exp().flatten(),
                         (2 * self.b_log_sigma.detach()).exp().flatten()])
        return mu.double(), var.double()


class Net(torch.nn.Module):
    """n_in -> hidden -> hidden/2 -> n_out with ReLU between the layers."""

    def __init__(self, n_in, n_out, dtype, hidden=64):
        super().__init__()
        self.layers = torch.nn.ModuleList([
            Bayesian(n_in, hidden, dtype),
            Bayesian(hidden, hidden // 2, dtype),
            Bayesian(hidden // 2, n_out, dtype),
        ])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)

    def mean_prior_kl(self):
        total, count = 0.0, 0
        for layer in self.layers:
            t, c = layer.prior_kl()
            total, count = total + t, count + c
        return total / count


def gaussian_kl(mu_q, var_q, mu_p, var_p):
    """KL(q || p) between factorised Gaussians."""
    return 0.5 * torch.sum(torch.log(var_p / var_q) + (var_q + (mu_q - mu_p) ** 2) / var_p - 1)


@torch.no_grad()
def predictive(net, x, target, samples):
    p = torch.stack([F.softmax(net(x), dim=-1)[:, target] for _ in range(samples)])
    return p.mean(0), p.var(0)


def load(path, dtype):
    """Standardised features and integer labels of a CSV file with a header row, label last."""
    rows = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, ndmin=2)
    x, y = rows[:, :-1], rows[:, -1].astype(np.int64)
    x = (x - x.mean(axis=0)) / x.std(axis=0)
    return torch.tensor(x, dtype=dtype), torch.tensor(y)


def time_runs(fn, reps):
    """Median and minimum wall time of reps runs of fn, after one untimed run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def predict_workload(args, dtype):
    net = Net(30, 2, dtype, args.hidden)
    x = torch.randn(args.inputs, 30, dtype=dtype)
    run = lambda: predictive(net, x, 1, args.samples)
    return run, {"inputs": args.inputs, "samples": args.samples, "hidden": args.hidden}


def update_workload(args, dtype):
    x, y = load(args.data, dtype)
    x, y = x[:64], y[:64]
    base = Net(x.shape[1], 2, dtype)

    def run():
        net = copy.deepcopy(base)
        for layer in net.layers[:-1]:
            layer.requires_grad_(False)
        last = net.layers[-1]
        mu_prev, var_prev = last.moments()
        opt = torch.optim.Adam(last.parameters(), lr=1e-5)
        for _ in range(50):
            opt.zero_grad()
            kl, _ = last.prior_kl()
            (F.cross_entropy(net(x), y) + 0.1 / 64 * kl).backward()
            opt.step()
        mu_new, var_new = last.moments()
        return gaussian_kl(mu_new, var_new, mu_prev, var_prev).item()

    return run, {"records": 64, "adam_steps": 50}


def train_workload(args, dtype):
    x, y = load(args.data, dtype)

    def run():
        net = Net(x.shape[1], 2, dtype)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        for _ in range(args.epochs):
            order = torch.randperm(len(x))
            for start in range(0, len(x), 64):
                batch = order[start:start + 64]
                opt.zero_grad()
                (F.cross_entropy(net(x[batch]), y[batch]) + 0.1 * net.mean_prior_kl()).backward()
                opt.step()

    return run, {"epochs": args.epochs, "batch": 64, "rows": len(x)}


WORKLOADS = {"predict": predict_workload, "update": update_workload, "train": train_workload}


def main(argv):
    ap = argparse.ArgumentParser(description="Time a PyTorch workload for vstorch.")
    ap.add_argument("what", choices=sorted(WORKLOADS))
    ap.add_argument("--dtype", choices=["32", "64"], default="64")
    ap.add_argument("--reps", type=int, default=5, help="timed runs after one untimed run")
    ap.add_argument("--data", help="CSV file for update and train (header row, label last)")
    ap.add_argument("--inputs", type=int, default=10000)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=300)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.what != "predict" and not args.data:
        ap.error(args.what + " needs --data")
    torch.set_num_threads(1)
    torch.manual_seed(1)
    dtype = torch.float32 if args.dtype == "32" else torch.float64
    run, facts = WORKLOADS[args.what](args, dtype)
    median_s, min_s = time_runs(run, args.reps)
    out = {"what": args.what, "dtype": "float" + args.dtype, "reps": args.reps,
           "median_s": median_s, "min_s": min_s}
    out.update(facts)
    if args.what == "predict":
        out["inputs_samples_per_s"] = args.inputs * args.samples / median_s
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
