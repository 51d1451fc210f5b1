package flood

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// The load case's sizes.
const (
	loadRecords    = 2000 // correctly labelled records of the bundled data set
	loadBatch      = 200  // produced at a time, one batch a second
	loadConcurrent = 40   // explanations and predictions, each, sent at once per round
	loadInputs     = 500  // per prediction
	loadFaultAfter = 1000 // records applied before a fetch is held back
)

// TestFloodWhileRecordsStreamKeepsIngesting is the load case: while 2000 correctly labelled
// records stream in, rounds of 40 concurrent POST /v1/explain and 40 concurrent POST
// /v1/predict of 500 inputs each hit the daemon, and in the middle of it one fetch is left
// unanswered (the client's per-request deadline passes: "kafka.(*Client).Fetch: context
// deadline exceeded", what a starved CPU produces) and the next one's connection is closed
// (EOF). The daemon must shed what it cannot run (429 with Retry-After), answer everything else
// correctly, never exit, answer /healthz (probed every 200 ms) within 5 s of what a handler that
// does nothing takes in the same process (healthProbes), resume ingest after the faults and
// apply every record while the flood goes on, and be ready at the end.
//
// The broker is a kfake cluster of the test's own (the embedded broker is the same kfake), so
// that the test can hold back a fetch; the daemon's consumer waits 11 s (the dial timeout plus
// twice the fetch wait) for the answer that never comes, so the flood lasts about 17 s: 5 s of
// ingest, the stall, and the catch-up.
func TestFloodWhileRecordsStreamKeepsIngesting(t *testing.T) {
	if testing.Short() {
		t.Skip("a flood of more than 10 s; trains the VAE")
	}
	const floodFor, floodMost = 12 * time.Second, 30 * time.Second
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "cfguard.records", "cfguard.records.dlq", "cfguard.events"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close) // after the daemon's cleanup
	// Predictions are admitted by their inputs: four of 500 at once, so that the flood's 40 must
	// be shed on any machine (the default bound, 10^4 inputs per CPU, admits all 40 on two).
	l := &loadCase{r: launch.Daemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		c.Kafka.Brokers = kc.ListenAddrs()
		c.HTTP.MaxPredictInputs = 4 * loadInputs
	})), kc: kc, data: daemontest.Bundled(t),
		tally: newLoadTally(), faulted: make(chan struct{})}
	l.client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * loadConcurrent}}
	t.Cleanup(l.client.CloseIdleConnections)

	ctx, stop := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	defer func() { stop(); bg.Wait() }()
	l.start = time.Now()
	bg.Go(func() { l.probes.run(ctx, l.r.Base+"/healthz", 200*time.Millisecond, 5*time.Second) })
	bg.Go(func() { l.produce(ctx) })
	bg.Go(func() { l.faultFetches(ctx) })

	rounds := 0
	for ; time.Since(l.start) < floodMost && l.stopped() == "" && l.produceErr.Load() == nil; rounds++ {
		if time.Since(l.start) >= floodFor && l.faultsBehind() && l.applied() == loadRecords {
			break
		}
		l.round(rounds)
		l.alive(t, "during the flood")
	}
	flood := time.Since(l.start)
	t.Logf("%d rounds in %v: explain %v, predict %v; slowest answers: explain %v, predict %v",
		rounds, flood.Round(time.Millisecond), l.tally.codes("explain"), l.tally.codes("predict"),
		l.tally.slowest["explain"].Round(time.Millisecond), l.tally.slowest["predict"].Round(time.Millisecond))
	// On a busy core the faults may come late in the flood: the held fetch's deadline and the cut
	// connection then pass after it, while the consumer polls on.
	took := waitfor.Cond(t, 30*time.Second, fmt.Sprintf("%d applied records and the fetch faults behind", loadRecords), func() bool {
		if why := l.stopped(); why != "" {
			t.Fatalf("ingest stopped with %v of %d records applied: %s", l.applied(), loadRecords, why)
		}
		if err := l.produceErr.Load(); err != nil {
			t.Fatal(*err)
		}
		return l.applied() == loadRecords && l.faultsBehind()
	})
	stop()
	bg.Wait()
	l.alive(t, "after the flood")
	t.Logf("/healthz: %d probes, slowest %v (a handler that does nothing: %v); a fetch held back at %v with %v records applied; all %d applied %v after the first was produced (%v after the flood); consumer retries %d",
		l.probes.n, l.probes.slowest.Round(time.Millisecond), l.probes.control.Round(time.Millisecond), l.faultAt.Round(time.Millisecond), l.faultApplied, loadRecords,
		time.Since(l.start).Round(time.Millisecond), took.Round(time.Millisecond), l.r.D.Consumer().Stats().Retries)
	l.check(t)
}

// loadCase is the state of TestFloodWhileRecordsStreamKeepsIngesting.
type loadCase struct {
	r      *launch.Running
	client *http.Client // keeps a connection per concurrent request
	kc     *kfake.Cluster
	data   *dataset.Set
	start  time.Time
	tally  *loadTally
	probes healthProbes

	produced   atomic.Int64
	produceErr atomic.Pointer[error]

	fetches      atomic.Int32  // fetches seen since the faults were set up
	faulted      chan struct{} // closed once they are
	faultAt      time.Duration // since start; with faultApplied, written before faulted is closed
	faultApplied float64
}

func (l *loadCase) applied() float64 {
	return daemontest.GatherCounter(l.r.Reg, "cfguard_records_total", "result", "applied")
}

// stopped is why the consumer stopped for good, or "".
func (l *loadCase) stopped() string {
	for _, why := range l.r.D.Consumer().Health().Reasons {
		if strings.HasPrefix(why, "stopped:") {
			return why
		}
	}
	return ""
}

// alive fails the test if Run has returned.
func (l *loadCase) alive(t *testing.T, when string) {
	t.Helper()
	if returned, err := l.r.Returned(); returned {
		t.Fatalf("the daemon exited %s: %v", when, err)
	}
}

// produce writes the records, a batch a second, until all are written or ctx ends.
func (l *loadCase) produce(ctx context.Context) {
	tr := &kafka.Transport{} // not kafka.DefaultTransport: see kafkatest.Transport
	defer tr.CloseIdleConnections()
	w := &kafka.Writer{Transport: tr, Addr: kafka.TCP(l.kc.ListenAddrs()...), Topic: l.r.Config.Kafka.Topic, RequiredAcks: kafka.RequireAll, BatchSize: loadBatch}
	defer w.Close()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for b := range loadRecords / loadBatch {
		msgs := make([]kafka.Message, loadBatch)
		for i := range msgs {
			k := b*loadBatch + i
			row := k % len(l.data.X)
			msgs[i] = kafka.Message{Value: daemontest.Record(fmt.Sprintf("load-%d", k), l.data.X[row], l.data.Y[row])}
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := w.WriteMessages(wctx, msgs...)
		cancel()
		if err != nil {
			err = fmt.Errorf("producing batch %d: %w", b, err)
			l.produceErr.Store(&err)
			return
		}
		l.produced.Add(loadBatch)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// faultFetches waits until ingest runs under the flood, then leaves the next fetch unanswered
// and closes the connection of the one after; the broker serves the rest.
func (l *loadCase) faultFetches(ctx context.Context) {
	for l.applied() < loadFaultAfter {
		select {
		case <-ctx.Done():
			return
		case <-time.After(waitfor.Interval):
		}
	}
	l.kc.ControlKey(int16(kmsg.Fetch), func(kmsg.Request) (kmsg.Response, error, bool) {
		switch l.fetches.Add(1) {
		case 1:
			l.kc.KeepControl()
			return nil, nil, true // no answer: the client's deadline passes
		case 2:
			l.kc.KeepControl()
			return nil, errors.New("connection closed by the test"), true
		}
		l.kc.DropControl()
		return nil, nil, false
	})
	l.faultAt, l.faultApplied = time.Since(l.start), l.applied()
	close(l.faulted)
}

// faultsBehind: a fetch after the two faulty ones reached the broker.
func (l *loadCase) faultsBehind() bool {
	select {
	case <-l.faulted:
		return l.fetches.Load() > 2
	default:
		return false
	}
}

// round sends loadConcurrent explanations and as many predictions at once and waits for every
// answer. Each must come within the time the daemon gives itself to write it (http.write_timeout,
// plus explain.timeout for an explanation; after it, the daemon cuts the answer) and 10 s more:
// on a core shared with 20 busy processes the four predictions admitted at once take over 30 s,
// as they should.
func (l *loadCase) round(n int) {
	predict, _ := json.Marshal(map[string]any{"xs": l.data.X[:loadInputs]})
	cfg := l.r.Config
	var wg sync.WaitGroup
	for i := range loadConcurrent {
		// Rows in turn, for the class the model does not give them (no target: the other class).
		explain, _ := json.Marshal(map[string]any{"x": l.data.X[(n*loadConcurrent+i)%len(l.data.X)]})
		wg.Go(func() { l.post("explain", explain, cfg.HTTP.WriteTimeout+cfg.Explain.Timeout+10*time.Second) })
		wg.Go(func() { l.post("predict", predict, cfg.HTTP.WriteTimeout+10*time.Second) })
	}
	wg.Wait()
}

// post sends one request and tallies its answer: 201 or 422 from explain, 200 with every
// prediction from predict, 429 with Retry-After from either; anything else, or no answer
// within the given time, is a failure.
func (l *loadCase) post(route string, body []byte, within time.Duration) {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", l.r.Base+"/v1/"+route, bytes.NewReader(body))
	start := time.Now()
	resp, err := l.client.Do(req)
	if err != nil {
		l.tally.fail(route, fmt.Sprintf("no answer within %v: %v", within, err))
		return
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		l.tally.fail(route, fmt.Sprintf("%d, body cut: %v", resp.StatusCode, err))
		return
	}
	l.tally.answer(route, resp.StatusCode, time.Since(start))
	switch {
	case resp.StatusCode == http.StatusTooManyRequests:
		if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || s < 1 {
			l.tally.fail(route, fmt.Sprintf("429 with Retry-After %q, want whole seconds >= 1", resp.Header.Get("Retry-After")))
		}
	case route == "predict" && resp.StatusCode == http.StatusOK:
		var p struct{ Predictions []json.RawMessage }
		if err := json.Unmarshal(b, &p); err != nil || len(p.Predictions) != loadInputs {
			l.tally.fail(route, fmt.Sprintf("200 with %d predictions of %d (%v)", len(p.Predictions), loadInputs, err))
		}
	case route == "explain" && (resp.StatusCode == http.StatusCreated || resp.StatusCode == http.StatusUnprocessableEntity):
	default:
		l.tally.fail(route, fmt.Sprintf("%d %.200s", resp.StatusCode, b))
	}
}

// check holds the outcome once every record is applied and the background work has stopped.
func (l *loadCase) check(t *testing.T) {
	t.Helper()
	for _, f := range l.tally.failures {
		t.Error(f)
	}
	for _, f := range l.probes.failures {
		t.Error(f)
	}
	if l.probes.n == 0 {
		t.Error("/healthz was never probed")
	}
	for _, route := range []string{"explain", "predict"} {
		if l.tally.n[route][http.StatusTooManyRequests] == 0 {
			t.Errorf("no %s was shed with 429 under %d concurrent requests: its route is not bounded", route, loadConcurrent)
		}
		if ok := l.tally.n[route][http.StatusOK] + l.tally.n[route][http.StatusCreated] + l.tally.n[route][http.StatusUnprocessableEntity]; ok == 0 {
			t.Errorf("no %s was answered: everything was shed", route)
		}
	}
	if !l.faultsBehind() {
		t.Errorf("the fetch faults were not exercised (%d fetches controlled)", l.fetches.Load())
	}
	if got := l.r.D.Consumer().Stats().Retries; got < 2 {
		t.Errorf("consumer retries %d, want at least 2 (the held-back fetch and the cut one)", got)
	}
	if code, body := l.r.Get(t, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz after the flood: %d %s", code, body)
	}
}

// loadTally counts a flood's answers by route and status code.
type loadTally struct {
	mu       sync.Mutex
	n        map[string]map[int]int
	slowest  map[string]time.Duration
	failures []string
}

func newLoadTally() *loadTally {
	return &loadTally{n: map[string]map[int]int{}, slowest: map[string]time.Duration{}}
}

func (l *loadTally) answer(route string, code int, took time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.n[route] == nil {
		l.n[route] = map[int]int{}
	}
	l.n[route][code]++
	l.slowest[route] = max(l.slowest[route], took)
}

// fail records a wrong answer; the first 10 are kept.
func (l *loadTally) fail(route, what string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.failures) < 10 {
		l.failures = append(l.failures, route+": "+what)
	}
}

// codes is "code:count ..." in code order.
func (l *loadTally) codes(route string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b bytes.Buffer
	for _, c := range slices.Sorted(maps.Keys(l.n[route])) {
		fmt.Fprintf(&b, "%d:%d ", c, l.n[route][c])
	}
	return string(bytes.TrimSpace(b.Bytes()))
}

// healthProbes asks for /healthz on a new connection every interval until ctx ends and, at the
// same moment, for a handler that does nothing, served by this test process: the control. Both
// answers wait for the same Go scheduler and the same share of a CPU, so the control's time is
// what any answer of the process takes, and /healthz may take at most limit more than it. On a
// core shared with eight busy loops the control alone takes seconds (the flood's goroutines are
// scheduled in turn), while a /healthz queued behind the flood's work would take as long as the
// flood's answers. An answer other than 200, or one later than that, is a failure.
type healthProbes struct {
	n        int
	slowest  time.Duration // of /healthz
	control  time.Duration // the slowest control
	failures []string
}

func (h *healthProbes) run(ctx context.Context, url string, every, limit time.Duration) {
	ctl := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer ctl.Close()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	get := func(url string) (time.Duration, int, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return 0, 0, err
		}
		start := time.Now()
		resp, err := c.Do(req)
		took := time.Since(start)
		if err != nil {
			return took, 0, err
		}
		resp.Body.Close()
		return took, resp.StatusCode, nil
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(every):
		}
		var control time.Duration
		var controlErr error
		var wg sync.WaitGroup
		wg.Go(func() { control, _, controlErr = get(ctl.URL) })
		took, code, err := get(url)
		wg.Wait()
		if ctx.Err() != nil {
			// Cut by the end of the flood: a probe later by then than the control allows is a
			// /healthz that hung (one that answers no more), else it is not counted.
			if err != nil && took > max(control, h.control)+limit {
				h.failures = append(h.failures, fmt.Sprintf("/healthz probe %d: no answer after %v, when the flood ended (a handler that does nothing: %v)",
					h.n+1, took.Round(time.Millisecond), max(control, h.control).Round(time.Millisecond)))
			}
			return
		}
		h.n++
		h.slowest, h.control = max(h.slowest, took), max(h.control, control)
		switch {
		case controlErr != nil:
			h.failures = append(h.failures, fmt.Sprintf("control probe %d: %v", h.n, controlErr))
		case err != nil:
			h.failures = append(h.failures, fmt.Sprintf("/healthz probe %d: %v", h.n, err))
		case code != http.StatusOK:
			h.failures = append(h.failures, fmt.Sprintf("/healthz probe %d: %d", h.n, code))
		case took > control+limit:
			h.failures = append(h.failures, fmt.Sprintf("/healthz probe %d answered in %v, more than %v beyond a handler that does nothing in the same process (%v)",
				h.n, took.Round(time.Millisecond), limit, control.Round(time.Millisecond)))
		}
	}
}

// TestHealthProbesCatchAHang: the flood's probes fail a /healthz that answers a few times and then
// hangs until the flood ends, as well as one that answers late, and pass one that answers.
func TestHealthProbesCatchAHang(t *testing.T) {
	for _, c := range []struct {
		name  string
		after int           // answers before it hangs (-1: never hangs)
		delay time.Duration // of every answer
		fails bool
	}{
		{"answers", -1, 0, false},
		{"hangs after two", 2, 0, true},
		{"late", -1, 1500 * time.Millisecond, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel() // each waits out its 3 s
			var n atomic.Int32
			release := make(chan struct{})
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if c.after >= 0 && int(n.Add(1)) > c.after {
					select {
					case <-release:
					case <-r.Context().Done():
					}
					return
				}
				time.Sleep(c.delay)
			}))
			defer srv.Close()
			defer close(release)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			var h healthProbes
			h.run(ctx, srv.URL, 100*time.Millisecond, time.Second)
			if fails := len(h.failures) > 0; fails != c.fails {
				t.Errorf("%d probes, failures %q; want failing: %v", h.n, h.failures, c.fails)
			}
		})
	}
}
