package daemon

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/ledger"
)

// handleModel reports the posterior: version, shape, the KL budget and history, anchors, counts.
// The posterior and the ledger's state are read as one snapshot: the applied count and offsets
// are those of the checkpoint that stored the posterior version reported.
func (a *api) handleModel(w http.ResponseWriter, r *http.Request) {
	var (
		m       *bnn.Model
		st      ledger.State
		hist    []ledger.KLEntry
		anchors []ledger.Anchor
	)
	err := a.core.snapshot(func(cur *bnn.Model) error {
		m = cur
		var err error
		if st, err = a.state.State(); err != nil {
			return err
		}
		if hist, err = a.state.KLHistory(100); err != nil {
			return err
		}
		anchors, err = a.state.Anchors()
		return err
	})
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"posterior_version": m.Version, "classes": m.Classes, "features": m.Features, "params": m.NumParams(),
		"kl_budget": a.cfg.budget, "delta": a.cfg.delta, "epsilon": a.cfg.epsilon, "mode": a.cfg.mode,
		"on_breach": a.cfg.onBreach, "kl_history": hist, "anchors": anchors, "applied": st.Applied,
		"offsets": st.Offsets, "counters": st.Counters, "counterfactuals": countsByName(st.Counts),
		"replication": a.core.replication(r.Context()), "prequential": a.core.prequential(), "records_represented": m.Records,
	})
}

// headerReplica names the replica that answered for a CE (replication.replica_id).
const headerReplica = "Cfguard-Replica"

// Headers of the posterior endpoints.
const (
	headerPosteriorVersion = "Cfguard-Posterior-Version"
	headerWeightsSHA256    = "Cfguard-Weights-Sha256"
)

// handlePosterior serves the current posterior in the format model.path reads: the weights as
// safetensors with torchbnn key names (GET /v1/model/posterior) and the JSON sidecar carrying
// the scaler, classes, architecture and the weights' SHA-256 (GET /v1/model/posterior/sidecar).
// Both carry the posterior version and the weights' SHA-256 as headers, and an ETag (the
// SHA-256 of the body) honoured by If-None-Match, so a model server can poll cheaply and check
// that the two halves belong together.
func (a *api) handlePosterior(w http.ResponseWriter, r *http.Request) {
	pf, err := a.core.posteriorFiles()
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	body, etag, ctype := pf.weights, pf.weightsETag, "application/octet-stream"
	if strings.HasSuffix(r.URL.Path, "/sidecar") {
		body, etag, ctype = pf.sidecar, pf.sidecarETag, "application/json"
	}
	h := w.Header()
	h.Set("ETag", etag)
	h.Set(headerPosteriorVersion, strconv.FormatUint(pf.version, 10))
	h.Set(headerWeightsSHA256, pf.weightsSHA256)
	h.Set("Cache-Control", "no-cache")
	if !preconditions(w, r, strings.Trim(etag, `"`), true, true, func() string {
		return fmt.Sprintf("the posterior's %s is %s now (version %d), which If-Match does not name", r.URL.Path, etag, pf.version)
	}) {
		return
	}
	h.Set("Content-Type", ctype)
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusOK)
	w.Write(body)
}

// predictRequest is one input (x) or a batch (xs).
type predictRequest struct {
	X  []float64   `json:"x"`
	XS [][]float64 `json:"xs"`
	// MinVersion, when set, is the least posterior version the answer may be under: a client
	// that read version v at one replica (a registration's anchor_version, a prediction's
	// posterior_version) asks another for v or later.
	MinVersion *uint64 `json:"min_version"`
}

// prediction is the predictive of one input under the current posterior.
type prediction struct {
	Class string    `json:"class"`
	Index int       `json:"index"`
	P     []float64 `json:"p"`   // E_q[p(c | x, w)] per class
	Var   []float64 `json:"var"` // Var_q[p(c | x, w)] per class
}

// maxPredictBatch bounds one /v1/predict request.
const maxPredictBatch = 10000

// predictRetryAfter is the Retry-After of a 429 from /v1/predict: most predictions take well
// under a second.
const predictRetryAfter = time.Second

// minVersionRetryAfter is the Retry-After of a prediction whose min_version this daemon has not
// applied.
const minVersionRetryAfter = time.Second

// handlePredict answers p, Var and the class under the current posterior, with its version, for
// model servers that delegate prediction. With min_version, under that version or a later one:
// it waits up to replication.register_wait for this daemon to apply it, then answers 503.
func (a *api) handlePredict(w http.ResponseWriter, r *http.Request) {
	var req predictRequest
	if err := decodeBody(r, &req); err != nil {
		writeBodyError(w, err)
		return
	}
	xs := req.XS
	if (req.X == nil) == (req.XS == nil) {
		writeError(w, http.StatusBadRequest, "give exactly one of x (one input) or xs (a batch)")
		return
	}
	if req.X != nil {
		xs = [][]float64{req.X}
	}
	if len(xs) == 0 || len(xs) > maxPredictBatch {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("xs must hold 1..%d inputs, got %d", maxPredictBatch, len(xs)))
		return
	}
	// Checked before any wait: inputs the model does not take are a 400, never a 503 to retry.
	m := a.core.current()
	if err := checkInputs(req, xs, m); err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	// Waited for before admission: a waiting request holds no share of http.max_predict_inputs.
	if req.MinVersion != nil && m.Version < *req.MinVersion {
		// The wait may take replication.register_wait: the response gets that long on top of
		// http.write_timeout, which a single daemon does not check the wait against (an error
		// here means the writer has no deadline to extend).
		http.NewResponseController(w).SetWriteDeadline(time.Now().Add(a.cfg.versionWait + a.cfg.writeTimeout))
		ctx, cancel := context.WithTimeout(r.Context(), a.cfg.versionWait)
		var err error
		m, err = a.core.awaitVersion(ctx, *req.MinVersion)
		cancel()
		if err != nil { // the daemon stops
			retryLater(w, http.StatusServiceUnavailable, writeRetryAfter, err.Error())
			return
		}
		if m.Version < *req.MinVersion {
			retryLater(w, http.StatusServiceUnavailable, minVersionRetryAfter, fmt.Sprintf("predict: min_version %d: this daemon serves posterior "+
				"version %d and did not apply %d within %v (replication.register_wait); retry later, or send the request to the replica "+
				"that served it", *req.MinVersion, m.Version, *req.MinVersion, a.cfg.versionWait))
			return
		}
		// The inputs need no second check: versions differ in the last layer only, so the
		// posterior applied meanwhile takes the inputs and scaler the first check read.
	}
	release, ok := a.predict.acquire(len(xs))
	if !ok {
		retryLater(w, http.StatusTooManyRequests, predictRetryAfter,
			fmt.Sprintf("predict: these %d inputs would take the predictions admitted past %d inputs (http.max_predict_inputs); retry later", len(xs), a.predict.max))
		return
	}
	defer release()
	p, err := a.core.predict(r.Context(), m, xs)
	if errors.Is(err, errPredictStopping) {
		retryLater(w, http.StatusServiceUnavailable, writeRetryAfter, err.Error())
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, err.Error())
		return
	}
	out := make([]prediction, len(xs))
	for i := range out {
		c := p.Argmax(i)
		out[i] = prediction{Class: m.Classes[c], Index: c, P: p.Mean[i*p.C : (i+1)*p.C], Var: p.Var[i*p.C : (i+1)*p.C]}
	}
	resp := map[string]any{"posterior_version": m.Version, "samples": p.S}
	if req.X != nil {
		resp["prediction"] = out[0]
	} else {
		resp["predictions"] = out
	}
	writeJSON(w, http.StatusOK, resp)
}

// checkInputs checks a prediction's inputs xs (req's x or xs) against m (checkVector), naming
// the first that m does not take as the request does: x, or xs[i].
func checkInputs(req predictRequest, xs [][]float64, m *bnn.Model) error {
	for i, x := range xs {
		name := fmt.Sprintf("xs[%d]", i)
		if req.X != nil {
			name = "x"
		}
		if err := checkVector(name, x, m); err != nil {
			return err
		}
	}
	return nil
}

// etagOf is a strong ETag for a body: its SHA-256 in hex, quoted.
func etagOf(sum string) string { return `"` + sum + `"` }
