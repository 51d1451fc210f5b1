#!/usr/bin/python3
"""A small HTTP model server for a posterior exported by cfguard.

It serves predictions from a cfguard model directory, the pair bnn.Save writes:

    model.safetensors   the posterior: per layer L, L.weight_mu, L.weight_log_sigma (out x in),
                        L.bias_mu, L.bias_log_sigma (out), float64 (float32 is accepted)
    model.json          the sidecar: format "cfguard-bnn", format_version 1, layers [{name, in, out}]
                        in network order, activation, output "log_softmax", scaler {mean, std},
                        classes, posterior_version, weights_sha256 (SHA-256 of model.safetensors)

and follows the directory as cfguard promotes new posteriors into it. It needs only the directory
(cfguard's model.export_dir, or any directory bnn.Save wrote), Debian's python3-torch and
python3-numpy, and the standard library.

    /usr/bin/python3 examples/model_server.py --model-dir DIR [--listen 127.0.0.1] [--port 8000]
        [--samples 1000] [--poll 1.0] [--seed 0]

Prediction is Monte-Carlo over the posterior, not the mean network: for raw features x,
z = (x - scaler.mean) / scaler.std, and with S = --samples independent draws of every weight and
bias, w = mu + exp(log_sigma) * e, e ~ N(0, 1),

    p_c(x)   = (1/S) sum_s softmax(f(z; w_s))_c                   (the posterior predictive)
    var_c(x) = 1/(S-1) sum_s (softmax(f(z; w_s))_c - p_c(x))^2    (its spread over the posterior)

which is what cfguard's bnn.Model.Predict estimates, so the two agree within Monte-Carlo error.
Every input of a request shares the S draws, seeded with --seed: a request's answer is a
deterministic function of the posterior and its inputs.

    POST /predict {"x": [..]}     -> {"p": [..], "var": [..], "class": name, "class_index": k,
                                       "posterior_version": v, "samples": S}
    POST /predict {"xs": [[..]]}  -> the same with a list per field
    GET  /healthz                 -> {"posterior_version", "weights_sha256", "reloads", "reloads_refused", ...}

Reloading: every --poll seconds the server reads model.json; when its (posterior_version,
weights_sha256) differs from the pair being served, it reads model.safetensors and checks its
SHA-256 against the sidecar. A mismatch means the directory is between two writes (bnn.Save
replaces the weights first and the sidecar last, each atomically): the server keeps serving the
pair it has, counts a refused reload, and tries again at the next poll. A consistent new pair is
built completely and then swapped in with one assignment, so a request sees the old posterior or
the new one, never a mix.
"""
import argparse
import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SIDECAR, WEIGHTS = "model.json", "model.safetensors"
MAX_BODY = 1 << 20

# numpy and torch, imported by import_torch once main has read the sidecar: importing torch takes
# seconds of CPU, and a directory without a model is named before that.
np = torch = F = None


def import_torch():
    global np, torch, F
    import numpy as np
    import torch
    import torch.nn.functional as F


def activations():
    """The activations a sidecar may name."""
    return {"relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


class ModelError(Exception):
    """The directory does not hold a usable model; the message names the file and the field."""


def read_safetensors(raw):
    """Parses safetensors bytes: an 8-byte little-endian header length N, N bytes of JSON
    {name: {dtype, shape, data_offsets}}, then the data. Returns {name: float64 tensor}."""
    if len(raw) < 8:
        raise ModelError(f"{WEIGHTS}: {len(raw)} bytes, shorter than the header length")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise ModelError(f"{WEIGHTS}: header length {n} exceeds the file (truncated?)")
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        raise ModelError(f"{WEIGHTS}: header: {e}")
    data = memoryview(raw)[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dtype = {"F64": "<f8", "F32": "<f4"}.get(e.get("dtype"))
        if dtype is None:
            raise ModelError(f"{WEIGHTS}: tensor {name!r} has dtype {e.get('dtype')!r}, want F64 or F32")
        shape, (lo, hi) = e["shape"], e["data_offsets"]
        count = math.prod(shape)
        if not (0 <= lo <= hi <= len(data)) or hi - lo != count * np.dtype(dtype).itemsize:
            raise ModelError(f"{WEIGHTS}: tensor {name!r} bytes [{lo},{hi}) do not fit shape {shape} in {len(data)} data bytes")
        arr = np.frombuffer(data[lo:hi], dtype=dtype).astype(np.float64)
        out[name] = torch.from_numpy(arr.reshape(shape))
    return out


class Posterior:
    """One consistent (sidecar, weights) pair, ready to predict."""

    def __init__(self, sidecar, weights_raw):
        sc = sidecar
        if sc.get("format") != "cfguard-bnn" or sc.get("format_version") != 1:
            raise ModelError(f"{SIDECAR}: format {sc.get('format')!r} version {sc.get('format_version')!r}, want cfguard-bnn version 1")
        if sc.get("output") != "log_softmax":
            raise ModelError(f"{SIDECAR}: output {sc.get('output')!r}, want log_softmax")
        self.activation = activations().get(sc.get("activation"))
        if self.activation is None:
            raise ModelError(f"{SIDECAR}: activation {sc.get('activation')!r}, want one of {sorted(activations())}")
        tensors = read_safetensors(weights_raw)
        self.layers = []
        prev = None
        for ls in sc.get("layers") or []:
            name, i, o = ls["name"], ls["in"], ls["out"]
            if prev is not None and i != prev:
                raise ModelError(f"{SIDECAR}: layer {name!r} takes {i} inputs but the previous layer gives {prev}")
            params = []
            for suffix, shape in (("weight_mu", [o, i]), ("weight_log_sigma", [o, i]), ("bias_mu", [o]), ("bias_log_sigma", [o])):
                t = tensors.pop(f"{name}.{suffix}", None)
                if t is None or list(t.shape) != shape:
                    raise ModelError(f"{WEIGHTS}: tensor {name}.{suffix} is missing or not shaped {shape}")
                params.append(t)
            wm, wls, bm, bls = params
            self.layers.append((wm, torch.exp(wls), bm, torch.exp(bls)))
            prev = o
        if not self.layers:
            raise ModelError(f"{SIDECAR}: no layers")
        if tensors:
            raise ModelError(f"{WEIGHTS}: tensors {sorted(tensors)} are not in {SIDECAR}'s layers")
        self.classes = sc.get("classes") or []
        if len(self.classes) != prev:
            raise ModelError(f"{SIDECAR}: {len(self.classes)} classes for {prev} outputs")
        scaler = sc.get("scaler") or {}
        self.mean = torch.tensor(scaler.get("mean") or [], dtype=torch.float64)
        self.std = torch.tensor(scaler.get("std") or [], dtype=torch.float64)
        self.inputs = self.layers[0][0].shape[1]
        if self.mean.shape != (self.inputs,) or self.std.shape != (self.inputs,) or not bool((self.std > 0).all()):
            raise ModelError(f"{SIDECAR}: scaler must have {self.inputs} means and positive standard deviations")
        self.version = sc.get("posterior_version")
        self.sha = sc.get("weights_sha256")

    def predict(self, xs, samples, seed, chunk=250):
        """Monte-Carlo predictive mean and variance (see the module documentation) for raw inputs
        xs (N x D); every input shares the draws."""
        with torch.no_grad():
            return self._predict(xs, samples, seed, chunk)

    def _predict(self, xs, samples, seed, chunk):
        z = (torch.tensor(xs, dtype=torch.float64) - self.mean) / self.std
        gen = torch.Generator().manual_seed(seed)
        total = torch.zeros(z.shape[0], len(self.classes), dtype=torch.float64)
        sq = torch.zeros_like(total)
        done = 0
        while done < samples:
            b = min(chunk, samples - done)
            h = z.unsqueeze(0).expand(b, -1, -1)
            for k, (wm, ws, bm, bs) in enumerate(self.layers):
                w = wm + ws * torch.randn((b,) + tuple(wm.shape), generator=gen, dtype=torch.float64)
                bias = bm + bs * torch.randn((b,) + tuple(bm.shape), generator=gen, dtype=torch.float64)
                h = torch.baddbmm(bias.unsqueeze(1), h, w.transpose(1, 2))
                if k + 1 < len(self.layers):
                    h = self.activation(h)
            p = F.softmax(h, dim=-1)
            total += p.sum(0)
            sq += (p * p).sum(0)
            done += b
        mean = total / samples
        var = ((sq - samples * mean * mean) / (samples - 1)).clamp(min=0)
        return mean, var


def load(model_dir):
    """Reads the sidecar and the weights and returns a Posterior, or raises ModelError; a weights
    file whose SHA-256 is not the sidecar's raises ModelError with mismatch=True."""
    try:
        with open(os.path.join(model_dir, SIDECAR), "rb") as f:
            sidecar = json.loads(f.read())
        with open(os.path.join(model_dir, WEIGHTS), "rb") as f:
            raw = f.read()
    except (OSError, ValueError) as e:
        raise ModelError(f"{model_dir}: {e}")
    got = hashlib.sha256(raw).hexdigest()
    if got != sidecar.get("weights_sha256"):
        err = ModelError(f"{WEIGHTS} has sha256 {got[:12]} but {SIDECAR} (posterior_version {sidecar.get('posterior_version')}) expects {str(sidecar.get('weights_sha256'))[:12]}: between two writes")
        err.mismatch = True
        raise err
    return Posterior(sidecar, raw)


def sidecar_key(model_dir):
    """(posterior_version, weights_sha256) of the sidecar on disk, or None if unreadable."""
    try:
        with open(os.path.join(model_dir, SIDECAR), "rb") as f:
            sc = json.loads(f.read())
        return sc.get("posterior_version"), sc.get("weights_sha256")
    except (OSError, ValueError):
        return None


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr, model_dir, posterior, samples, seed):
        super().__init__(addr, Handler)
        self.model_dir, self.posterior, self.samples, self.seed = model_dir, posterior, samples, seed
        self.reloads = self.refused = 0
        self.broken = None  # the sidecar key of a pair that failed for another reason than a mismatch
        self.stop = threading.Event()

    def watch(self, poll):
        """Reloads the posterior when the sidecar names another pair; see the module documentation."""
        while not self.stop.wait(poll):
            cur = self.posterior
            key = sidecar_key(self.model_dir)
            if key is None or key == (cur.version, cur.sha) or key == self.broken:
                continue
            try:
                new = load(self.model_dir)
            except ModelError as e:
                self.refused += 1
                if not getattr(e, "mismatch", False):
                    self.broken = key  # not retried until the sidecar changes again
                log(f"keeping posterior_version {cur.version}: {e}")
                continue
            self.posterior = new  # one assignment: requests see the old pair or the new one
            self.reloads += 1
            log(f"reloaded posterior_version {new.version} (weights sha256 {new.sha[:12]})")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):
        pass

    def reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path != "/healthz":
            return self.reply(404, {"error": f"no such path {self.path}; POST /predict or GET /healthz"})
        m, s = self.server.posterior, self.server
        self.reply(200, {"posterior_version": m.version, "weights_sha256": m.sha, "classes": m.classes,
                         "inputs": m.inputs, "samples": s.samples, "reloads": s.reloads, "reloads_refused": s.refused})

    def do_POST(self):
        if self.path != "/predict":
            return self.reply(404, {"error": f"no such path {self.path}; POST /predict"})
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            return self.reply(413, {"error": f"body of {n} bytes exceeds {MAX_BODY}"})
        m = self.server.posterior  # read once: this request uses one posterior
        try:
            req = json.loads(self.rfile.read(n))
            single = "x" in req
            xs = [req["x"]] if single else req.get("xs")
            if not isinstance(xs, list) or not xs or ("x" in req and "xs" in req):
                raise ValueError('want {"x": [features]} or {"xs": [[features], ...]}')
            for i, x in enumerate(xs):
                if not isinstance(x, list) or len(x) != m.inputs or not all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in x):
                    raise ValueError(f"input {i}: want {m.inputs} finite numbers")
        except (ValueError, AttributeError, TypeError) as e:
            return self.reply(400, {"error": str(e)})
        p, var = m.predict(xs, self.server.samples, self.server.seed)
        k = p.argmax(1).tolist()
        out = {"p": p.tolist(), "var": var.tolist(), "class": [m.classes[i] for i in k], "class_index": k,
               "posterior_version": m.version, "samples": self.server.samples}
        if single:
            for f in ("p", "var", "class", "class_index"):
                out[f] = out[f][0]
        self.reply(200, out)


def log(msg):
    print(f"model_server: {msg}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="directory with model.safetensors + model.json (cfguard's model.export_dir)")
    ap.add_argument("--listen", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port; the address is printed on stdout")
    ap.add_argument("--samples", type=int, default=1000, help="posterior draws per request (>= 2)")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between checks of the sidecar")
    ap.add_argument("--seed", type=int, default=0, help="seed of every request's draws")
    args = ap.parse_args()
    if args.samples < 2 or not args.poll > 0:
        ap.error("--samples must be >= 2 and --poll > 0")
    # The sidecar before torch: a directory without a model is named at once.
    sidecar = os.path.join(args.model_dir, SIDECAR)
    try:
        with open(sidecar, "rb") as f:
            json.loads(f.read())
    except (OSError, ValueError) as e:
        sys.exit(f"model_server: {sidecar}: {e}")
    import_torch()
    torch.set_num_threads(1)
    # At start the directory may be between two writes: retry a mismatched pair briefly.
    for attempt in range(50):
        try:
            posterior = load(args.model_dir)
            break
        except ModelError as e:
            if not getattr(e, "mismatch", False) or attempt == 49:
                sys.exit(f"model_server: {e}")
            time.sleep(0.1)
    srv = Server((args.listen, args.port), args.model_dir, posterior, args.samples, args.seed)
    watcher = threading.Thread(target=srv.watch, args=(args.poll,), daemon=True)
    watcher.start()

    def stop(*_):
        srv.stop.set()
        threading.Thread(target=srv.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = srv.server_address[:2]
    print(json.dumps({"listening": f"{host}:{port}", "posterior_version": posterior.version,
                      "weights_sha256": posterior.sha, "samples": args.samples}), flush=True)
    srv.serve_forever()
    srv.server_close()
    watcher.join()
    log("stopped")


if __name__ == "__main__":
    main()
