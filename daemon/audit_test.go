package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestIngestContinuesDuringAnAudit: an audit does not hold the daemon's lock, so increments are
// applied while it runs rather than after the whole audit, and the audit still evaluates every
// stored CE. The figures (ingest rate during an audit of 10^5 CEs over the rate
// without) are BenchmarkIngestDuringAudit's.
func TestIngestContinuesDuringAnAudit(t *testing.T) {
	const n = 2000
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	daemontest.StoreCEs(t, r, data, n)
	type result struct {
		evaluated int
		err       error
	}
	// The audit is held after its first batch (of 1024) until the records are applied, so that
	// they are applied while it runs however fast the machine: if ingestion waited for the
	// audit, they never would be.
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.D.hooks.AuditBatchDone = func(done, total int) {
		if done < total {
			once.Do(func() { close(held); <-release })
		}
	}
	done := make(chan result, 1)
	go func() {
		rep, err := r.D.runAudit(context.Background(), "test")
		done <- result{rep.Evaluated, err}
	}()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	select {
	case <-held:
	case <-time.After(60 * time.Second):
		t.Fatal("the audit's first batch was not written within 60 s")
	}
	var vals [][]byte
	for i := 0; i < 64; i++ {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 60*time.Second, "64 records applied while the audit is held between its batches",
		func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 })
	if !r.D.auditStatus().Running {
		t.Fatal("the audit is not running while held between its batches")
	}
	close(release)
	res := <-done
	if res.err != nil || res.evaluated != n {
		t.Fatalf("audit: evaluated %d of %d CEs, err %v", res.evaluated, n, res.err)
	}
}

// TestAuditMeasuresWhileRecordsStream: records stream while an audit runs, and every one of
// them promotes a posterior before the audit's first batch is read and again between its
// batches, as on a busy machine where ingestion commits faster than an audit draws its networks.
// POST /v1/audit still answers 200: every CE is evaluated under the posterior the audit started
// with, each batch written behind the newest one. The audit is held at those two points (hooks,
// no sleeps) while the test streams an increment and waits for its posterior.
func TestAuditMeasuresWhileRecordsStream(t *testing.T) {
	const n = backgroundBatch + 100 // two batches
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	daemontest.StoreCEs(t, r, data, n)
	type hold struct {
		version uint64
		resume  chan struct{}
	}
	held := make(chan hold)
	wait := func(ctx context.Context, v uint64) {
		h := hold{v, make(chan struct{})}
		select {
		case held <- h:
		case <-ctx.Done():
			return
		}
		select {
		case <-h.resume:
		case <-ctx.Done():
		}
	}
	r.D.hooks.AuditPoolReady = wait
	r.D.hooks.AuditBatchDone = func(done, total int) {
		if done < total {
			wait(context.Background(), 0)
		}
	}
	type answer struct {
		code int
		body []byte
	}
	answered := make(chan answer, 1)
	go func() {
		req, _ := http.NewRequest("POST", r.Base+"/v1/audit", strings.NewReader("{}"))
		resp, err := r.Client.Do(req)
		if err != nil {
			answered <- answer{0, []byte(err.Error())}
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		answered <- answer{resp.StatusCode, b}
	}()
	started := r.D.current().Version
	increments, next := 0, 0
	var got answer
	for done := false; !done; {
		select {
		case h := <-held:
			if increments == 4 {
				close(h.resume)
				t.Fatalf("the audit stopped %d times for a promoted posterior: it restarts instead of measuring under the posterior it started with", increments)
			}
			before := r.D.current().Version
			var vals [][]byte
			for i := 0; i < r.D.cfg.Kafka.MaxRecords; i, next = i+1, next+1 {
				vals = append(vals, daemontest.Record(fmt.Sprintf("stream-%d", next), data.X[next%len(data.X)], data.Y[next%len(data.Y)]))
			}
			r.Produce(t, vals...)
			waitfor.Cond(t, 60*time.Second, "a posterior promoted from the streamed increment",
				func() bool { return r.D.current().Version > before })
			increments++
			close(h.resume)
		case got = <-answered:
			done = true
		}
	}
	if got.code != http.StatusOK {
		t.Fatalf("POST /v1/audit while records stream: %d %s", got.code, got.body)
	}
	var rep ledger.AuditReport
	if err := json.Unmarshal(got.body, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.PosteriorVersion != started || rep.Evaluated != n || rep.Batches != 2 || rep.Behind != 2 || increments != 2 {
		t.Fatalf("audit report %+v after %d streamed increments: want %d CEs evaluated under posterior %d in 2 batches, both behind the newest posterior",
			rep, increments, n, started)
	}
	if st := r.D.auditStatus(); st.Running || st.LastError != "" || st.Last == nil {
		t.Fatalf("GET /v1/audit after the audit: %+v", st)
	}
}

// TestAuditCompletedEventAndCounters: a successful audit publishes one audit_completed event
// naming the posterior version it measured under and its counts per status (as in its report),
// counts one audit in cfguard_audits_total, and adds the CEs it re-anchored to
// cfguard_counterfactuals_renewed_total. The CEs are stored before an increment, so the audit
// re-anchors them to the newer posterior.
func TestAuditCompletedEventAndCounters(t *testing.T) {
	r := startDaemon(t, nil)
	data := daemontest.Bundled(t)
	daemontest.StoreCEs(t, r, data, 20)
	v := r.D.current().Version
	var vals [][]byte
	for i := range 32 {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "the increment applied", func() bool { return r.D.current().Version > v })
	audits, renewed := r.Metric(t, alerts.NameAudits), r.Metric(t, alerts.NameRenewed)

	code, body := r.Do(t, "POST", "/v1/audit", "", nil)
	if code != http.StatusOK {
		t.Fatalf("POST /v1/audit: %d %s", code, body)
	}
	var rep ledger.AuditReport
	if err := json.Unmarshal(body, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Evaluated != 20 || rep.Reanchored == 0 {
		t.Fatalf("audit report %+v: want the 20 CEs evaluated and some re-anchored", rep)
	}
	if got := r.Metric(t, alerts.NameAudits); got != audits+1 {
		t.Errorf("%s %v after an audit, want %v", alerts.NameAudits, got, audits+1)
	}
	if got := r.Metric(t, alerts.NameRenewed); got < renewed+float64(rep.Reanchored) {
		t.Errorf("%s %v after an audit that re-anchored %d, want at least %v", alerts.NameRenewed, got, rep.Reanchored, renewed+float64(rep.Reanchored))
	}
	waitfor.Cond(t, 30*time.Second, "the outbox drained", func() bool { return r.Metric(t, "cfguard_events_pending") == 0 })
	var completed []Event
	for _, m := range kafkatest.ReadPartition(t, r.D.BrokerAddrs(), r.D.cfg.Kafka.EventsTopic, 0) {
		var e Event
		if err := json.Unmarshal(m.Value, &e); err == nil && e.Type == "audit_completed" {
			completed = append(completed, e)
		}
	}
	if len(completed) != 1 || completed[0].PosteriorVersion != rep.PosteriorVersion || !maps.Equal(completed[0].Counts, countsByName(rep.Counts)) {
		t.Fatalf("audit_completed events %+v, want one for posterior %d with counts %v", completed, rep.PosteriorVersion, countsByName(rep.Counts))
	}
}
