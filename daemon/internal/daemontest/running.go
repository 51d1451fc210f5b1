package daemontest

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/replica"
)

// Server is what the helpers ask of a started daemon: where its API and its brokers listen, the
// posterior it serves, its ledger, its place in the posterior log and its CE share.
// *daemon.Daemon is one.
type Server interface {
	HTTPAddr() string
	BrokerAddrs() []string
	Posterior() *bnn.Model
	Ledger() *ledger.Ledger
	Replica() *replica.Replica
	Share() *cluster.Share
}

// RunFunc runs a daemon on c until ctx is cancelled, logging to log and registering its
// metrics on reg, and sends it on ready once its API serves: daemon.Run with daemon.Options
// made of these.
type RunFunc[S Server] func(ctx context.Context, c *config.Config, log *slog.Logger, reg *prometheus.Registry, ready chan<- S) error

// Running is a daemon a test started, and the client the test talks to it with.
type Running[S Server] struct {
	D      S                    // the daemon, as Run sent it on ready
	Config *config.Config       // the configuration it runs on
	Logs   *tooltest.Output     // what it logged at WARN and above, for tests that check a message
	Reg    *prometheus.Registry // its metrics
	Base   string               // its API's URL: http:// or https:// and its address
	Client *http.Client         // the API's client: http.DefaultClient, or one that speaks TLS

	cancel context.CancelFunc
	done   chan error
}

// StartWith runs run on c in a goroutine and returns once the daemon is started (not
// necessarily ready: WaitReady waits for /readyz), failing the test if that takes over 60 s.
// When client is not nil, the test speaks TLS to the daemon with it. The daemon logs at WARN and
// above to the test's log and to Logs; a log line that repeats a key fails the test. The test's
// cleanup stops the daemon (Stop).
func StartWith[S Server](t testing.TB, c config.Config, client *http.Client, run RunFunc[S]) *Running[S] {
	t.Helper()
	return StartWithin(t, c, client, run, 60*time.Second)
}

// StartWithin is StartWith for a start that may take longer than 60 s (a first start that
// trains the bundled model on a busy core): it fails the test if the start takes over within.
func StartWithin[S Server](t testing.TB, c config.Config, client *http.Client, run RunFunc[S], within time.Duration) *Running[S] {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	reg := prometheus.NewRegistry()
	ready := make(chan S, 1)
	done := make(chan error, 1)
	logs := &tooltest.Output{}
	log := tooltest.Logger(t, logs)
	go func() { done <- run(ctx, &c, log, reg, ready) }()
	r := &Running[S]{Config: &c, Reg: reg, cancel: cancel, done: done, Logs: logs, Client: http.DefaultClient}
	scheme := "http://"
	if client != nil {
		r.Client, scheme = client, "https://"
	}
	StopAtCleanup(t, cancel, done)
	select {
	case r.D = <-ready:
	case err := <-done:
		done <- nil // Run has returned: the cleanup has nothing to wait for
		t.Fatalf("daemon failed to start: %v", err)
	case <-time.After(within):
		t.Fatalf("daemon did not start within %v", within)
	}
	r.Base = scheme + r.D.HTTPAddr()
	return r
}

// WaitReady waits up to within for the daemon's /readyz to answer 200, and returns r.
func (r *Running[S]) WaitReady(t testing.TB, what string, within time.Duration) *Running[S] {
	t.Helper()
	waitfor.Cond(t, within, what, func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	return r
}

// StopAtCleanup stops, when the test ends, the daemon whose Run reports to done (Stop). A test
// that saw Run return puts nil back in done.
func StopAtCleanup(t testing.TB, cancel context.CancelFunc, done chan error) {
	t.Cleanup(func() { Stop(t, cancel, done) })
}

// Stop cancels Run's context and fails the test when Run returns an error (a stop is clean) or
// has not returned 30 s later.
func Stop(t testing.TB, cancel context.CancelFunc, done chan error) {
	t.Helper()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("daemon: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Error("daemon did not stop within 30 s of cancel")
	}
}

// Stop stops the daemon and waits for it, failing the test if it returns an error.
func (r *Running[S]) Stop(t testing.TB) {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("daemon stopped with %v", err)
		}
		r.done <- nil // for the cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("daemon did not stop within 30 s")
	}
}

// Returned says whether the daemon's Run has returned, and with which error, without waiting.
func (r *Running[S]) Returned() (bool, error) {
	select {
	case err := <-r.done:
		r.done <- err // for the cleanup
		return true, err
	default:
		return false, nil
	}
}

// RawDo sends a request with a raw body and headers and returns the response with its body read.
func (r *Running[S]) RawDo(t testing.TB, method, path, body string, header map[string]string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, r.Base+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := r.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

// KeyedDo POSTs body (JSON of v, or raw when v is a string) to path with the Idempotency-Key
// key: the status code and body of the answer.
func (r *Running[S]) KeyedDo(t testing.TB, path, key string, v any) (int, []byte) {
	t.Helper()
	body, ok := v.(string)
	if !ok {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		body = string(b)
	}
	resp, got := r.RawDo(t, "POST", path, body, map[string]string{"Idempotency-Key": key})
	return resp.StatusCode, got
}

// Listed reads the first 1000 CEs of GET /v1/counterfactuals: the status, the body and, on 200,
// how many CEs it lists.
func (r *Running[S]) Listed(t testing.TB) (int, []byte, int) {
	t.Helper()
	code, body := r.Get(t, "/v1/counterfactuals?limit=1000")
	var page struct {
		CEs []ledger.CE `json:"counterfactuals"`
	}
	if code == http.StatusOK {
		if err := json.Unmarshal(body, &page); err != nil {
			t.Fatalf("GET /v1/counterfactuals: %v: %s", err, body)
		}
	}
	return code, body, len(page.CEs)
}

// Get is GET path from the API: its status code and body.
func (r *Running[S]) Get(t testing.TB, path string) (int, []byte) {
	t.Helper()
	resp, err := r.Client.Get(r.Base + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// Do sends method path with body as JSON (none when nil) and token as a bearer token (none
// when empty): the status code and body of the answer.
func (r *Running[S]) Do(t testing.TB, method, path, token string, body any) (int, []byte) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, r.Base+path, rd)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := r.Client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// GatherCounter reads a counter (or gauge) with the given label pairs without a *testing.T, for
// a goroutine; -1 when there is none.
func GatherCounter(reg *prometheus.Registry, name string, labels ...string) float64 {
	v, ok, _ := gather(reg, name, labels...)
	if !ok {
		return -1
	}
	return v
}

// gather finds in reg the gauge or counter name whose labels include the label pairs labels
// (name, value, ...): its value, whether there is one, and the error Gather gave (what it
// gathered is searched all the same).
func gather(reg *prometheus.Registry, name string, labels ...string) (float64, bool, error) {
	mfs, err := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || lp.GetName() == labels[i] && lp.GetValue() == labels[i+1]
				}
				if !found {
					continue next
				}
			}
			if g := m.GetGauge(); g != nil {
				return g.GetValue(), true, err
			}
			return m.GetCounter().GetValue(), true, err
		}
	}
	return 0, false, err
}

// HeldCEs is how many CEs the daemon's ledger holds.
func (r *Running[S]) HeldCEs(t testing.TB) int {
	t.Helper()
	c, err := r.D.Ledger().Counts()
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for _, n := range c {
		held += n
	}
	return held
}

// RegistrationBatches reads the histogram cfguard_counterfactuals_registration_batch_size: how many
// ledger writes stored registrations, and how many CEs they stored.
func (r *Running[S]) RegistrationBatches(t testing.TB) (writes uint64, stored float64) {
	t.Helper()
	mfs, err := r.Reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == alerts.NameRegistrationBatch {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	t.Fatalf("%s is not registered", alerts.NameRegistrationBatch)
	return 0, 0
}

// Metric is the value of the gauge or counter name whose labels include the label pairs
// labels (name, value, ...), as the daemon's registry holds it; the test fails when there is none.
func (r *Running[S]) Metric(t testing.TB, name string, labels ...string) float64 {
	t.Helper()
	v, ok, err := gather(r.Reg, name, labels...)
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Fatalf("metric %s%v not found", name, labels)
	}
	return v
}

// Produce writes JSON records to the daemon's topic over TCP with kafka-go, in batches of up to
// produceBatch records, each written within 30 s (a busy core, where the daemon consumes while
// the test produces, stretches a write of thousands). The writer sends a batch when it is full,
// or after BatchTimeout (kafka-go's default, 1 s): a batch the size of the write is full, and
// sent, as soon as WriteMessages has queued it.
func (r *Running[S]) Produce(t testing.TB, values ...[]byte) {
	t.Helper()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(r.D.BrokerAddrs()...), Topic: r.Config.Kafka.Topic, RequiredAcks: kafka.RequireAll,
		BatchSize: min(len(values), produceBatch)}
	defer w.Close()
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Value: v}
	}
	for from := 0; from < len(msgs); from += produceBatch {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := w.WriteMessages(ctx, msgs[from:min(from+produceBatch, len(msgs))]...)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
}

// produceBatch is the most records Produce writes in one batch.
const produceBatch = 500

// WaitResetReported waits until the daemon's /readyz answers 503 naming a reset of its input topic.
func (r *Running[S]) WaitResetReported(t testing.TB, what string) {
	t.Helper()
	waitfor.Cond(t, 30*time.Second, what, func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "was reset")
	})
}

// ModelView is what GET /v1/model reports of the posterior, the ledger beside it and, on a
// replica, its place in the posterior log.
type ModelView struct {
	Version uint64           `json:"posterior_version"`
	Applied int64            `json:"applied"`
	Offsets map[string]int64 `json:"offsets"`
	History []struct {
		Version uint64 `json:"posterior_version"`
	} `json:"kl_history"`
	Replication struct {
		Writer  string        `json:"writer"`
		Updater bool          `json:"updater"`
		Entry   uint64        `json:"entry"`
		Term    uint64        `json:"term"`
		SHA     string        `json:"posterior_sha256"`
		Covers  map[int]int64 `json:"covers"`
		Genesis string        `json:"genesis"`
	} `json:"replication"`
}

// Model reads GET /v1/model, failing t unless it answers 200 with JSON.
func (r *Running[S]) Model(t testing.TB) ModelView {
	t.Helper()
	code, body := r.Get(t, "/v1/model")
	if code != http.StatusOK {
		t.Fatalf("GET /v1/model: %d %s", code, body)
	}
	var v ModelView
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("GET /v1/model: %v: %s", err, body)
	}
	return v
}
