package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// Each kind of write durably retries has its own failure episode: on a full disk a small share
// write can succeed while a checkpoint keeps failing, and that success ends neither the
// checkpoint's episode nor its gauge; /readyz names each kind that is failing.
func TestRetriedWritesFailApart(t *testing.T) {
	l := openLedger(t)
	reg := prometheus.NewRegistry()
	d := &Daemon{ledger: l, metrics: alerts.NewMetrics(reg), log: slog.New(slog.DiscardHandler)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	full := fmt.Errorf("no space left on device: %w", ledger.ErrWrite)
	go func() { done <- d.durably(ctx, checkpointWrite, func() error { return full }) }()
	defer func() { cancel(); <-done }()
	waitfor.Cond(t, 10*time.Second, "the checkpoint failing", func() bool { return d.checkpointHealth() != nil })

	attempts := 0
	err := d.durably(ctx, shareWrite, func() error {
		attempts++
		if attempts == 1 {
			if h := d.checkpointHealth(); h != nil && strings.Contains(h.Error(), "CE share write") {
				t.Errorf("/readyz names a share write before one failed: %v", h)
			}
			return full
		}
		if h := d.checkpointHealth(); h == nil || !strings.Contains(h.Error(), "checkpoint to") || !strings.Contains(h.Error(), "CE share write to") {
			t.Errorf("/readyz while both fail: %v; want each kind named", h)
		}
		return nil
	})
	if err != nil || attempts != 2 {
		t.Fatalf("the share write: %v after %d attempts", err, attempts)
	}
	h := d.checkpointHealth()
	if h == nil || !strings.Contains(h.Error(), "checkpoint to") || strings.Contains(h.Error(), "CE share write") {
		t.Errorf("/readyz after the share write succeeded, the checkpoint failing still: %v", h)
	}
	want := "# HELP cfguard_checkpoint_failing 1 while the daemon cannot write its checkpoint (and has stopped consuming) or, on a replica, a write of its CE share, else 0.\n" +
		"# TYPE cfguard_checkpoint_failing gauge\ncfguard_checkpoint_failing 1\n"
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), alerts.NameCheckpointFailing); err != nil {
		t.Errorf("after the share write succeeded, the checkpoint failing still: %v", err)
	}
}

// TestBulkCutAfterItsFirstBatchSaysWhatMayBeStored: a bulk registration whose second batch cannot
// be written answers 503 naming the line it stopped at and saying that the lines before it may
// be stored, not that nothing was: they are.
func TestBulkCutAfterItsFirstBatchSaysWhatMayBeStored(t *testing.T) {
	var commits, failFrom atomic.Int32 // failFrom: the first commit that fails, 0 for none
	logs := &tooltest.Output{}
	r := startDaemonWith(t, nil, func(o *Options) {
		o.Logger = slog.New(slog.NewTextHandler(logs, nil))
		o.Hooks.LedgerAfterCommit = func() error {
			if n := commits.Add(1); failFrom.Load() != 0 && n >= failFrom.Load() {
				return errors.New("injected: fdatasync: input/output error")
			}
			return nil
		}
	}, nil)
	waitfor.Cond(t, 20*time.Second, "readyz", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	data := daemontest.Bundled(t)
	_, xs, cfs := daemontest.CandidatePairs(t, r.D.current(), data, 400, 1)
	var lines strings.Builder
	n := maxRegisterBatch + 10
	for k := range n {
		line, _ := json.Marshal(map[string]any{"id": fmt.Sprintf("cut-%d", k), "x": data.X[xs[k%len(xs)]], "x_cf": data.X[cfs[k%len(cfs)]], "target": "benign"})
		lines.Write(append(line, '\n'))
	}
	failFrom.Store(commits.Load() + 2) // the first batch's commit succeeds, the second's fails
	resp, body := r.RawDo(t, "POST", "/v1/counterfactuals:bulk", lines.String(), nil)
	want := fmt.Sprintf("stopped at line %d: the lines before it may be stored", maxRegisterBatch+1)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), want) || strings.Contains(string(body), "nothing was stored") ||
		!strings.Contains(string(body), "see /readyz") {
		t.Errorf("a bulk whose second batch cannot be written: %d %s; want 503 saying %q and naming /readyz", resp.StatusCode, body, want)
	}
	if code, body := r.Get(t, "/v1/counterfactuals/cut-0"); code != http.StatusOK {
		t.Errorf("line 1, in the first batch: %d %s; want it stored", code, body)
	}
	// Its lines log nothing of their own: the request's line says what it stored.
	if want := fmt.Sprintf(`msg="bulk registration cut" lines=%d at_line=%d stored=%d accepted=0 exists=0 refused=0 in_doubt=10`,
		n, maxRegisterBatch+1, maxRegisterBatch); !strings.Contains(logs.String(), want) {
		t.Errorf("the log does not say %q:\n%s", want, logs.String())
	}
	// A first batch that cannot be written stored nothing, also when it starts at line 2.
	resp, body = r.RawDo(t, "POST", "/v1/counterfactuals:bulk", "\n"+strings.ReplaceAll(lines.String(), "cut-", "again-"), nil)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "nothing was stored") {
		t.Errorf("a bulk whose first batch, from line 2, cannot be written: %d %s; want 503 saying nothing was stored", resp.StatusCode, body)
	}
}

// A bulk registration cut by a write that fails or a daemon that stops, after lines of it were
// handled, answers 503 with a Retry-After of 10 s that names the line it stopped at, why it
// stopped, and what sending it again does: with an Idempotency-Key every line applied answers as
// it did, without one a line without an id is stored again. Cut at its first line, or by a
// refusal of another kind, it is answered as a single registration is.
func TestBulkCutSaysWhatSendingAgainDoes(t *testing.T) {
	write := fmt.Errorf("commit: %w", ledger.ErrWrite)
	for _, c := range []struct {
		name         string
		err          error
		first, keyed bool
		code         int
		says, not    []string
	}{
		{"a failed write after lines were handled, without a key", write, false, false, 503,
			[]string{"the ledger cannot be written now (see /readyz)", "stopped at line 7", "a line without an id is stored again"},
			[]string{"Idempotency-Key", "nothing was stored"}},
		{"a stop after lines were handled, with a key", errStopping, false, true, 503,
			[]string{"the daemon is stopping", "stopped at line 7", "with the same Idempotency-Key, every line already applied answers as it did"},
			[]string{"cannot be written", "a line without an id is stored again"}},
		{"a failed write at the first line", write, true, true, 503,
			[]string{"nothing was stored, retry later"}, []string{"stopped at line"}},
		{"a reused key after lines were handled", errKeyReused, false, true, 422,
			[]string{errKeyReused.Error()}, []string{"stopped at line"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			w := httptest.NewRecorder()
			writeBulkCut(w, c.err, 7, c.first, c.keyed)
			var e struct{ Error string }
			if w.Code != c.code || json.Unmarshal(w.Body.Bytes(), &e) != nil {
				t.Fatalf("%d %s, want %d with a JSON error", w.Code, w.Body, c.code)
			}
			if want := map[bool]string{true: "10", false: ""}[c.code == 503]; w.Header().Get("Retry-After") != want {
				t.Errorf("Retry-After %q, want %q", w.Header().Get("Retry-After"), want)
			}
			for _, s := range c.says {
				if !strings.Contains(e.Error, s) {
					t.Errorf("error %q does not say %q", e.Error, s)
				}
			}
			for _, s := range c.not {
				if strings.Contains(e.Error, s) {
					t.Errorf("error %q says %q", e.Error, s)
				}
			}
		})
	}
}

// A write durably retries is tried again after each ledger.ErrWrite until it succeeds: every
// failed attempt counts in cfguard_checkpoint_failures_total, the episode logs one ERROR line
// when it starts and one INFO line with the failed attempts when it ends, and the gauge is back
// to 0. A write that succeeds at once logs nothing, and an error other than ErrWrite is returned
// at once, uncounted.
func TestDurablyRetriesUntilTheWriteSucceeds(t *testing.T) {
	l := openLedger(t)
	reg := prometheus.NewRegistry()
	logs := &tooltest.Output{}
	d := &Daemon{ledger: l, metrics: alerts.NewMetrics(reg), log: slog.New(slog.NewTextHandler(logs, nil))}
	ctx := context.Background()
	if err := d.durably(ctx, checkpointWrite, func() error { return nil }); err != nil || logs.String() != "" {
		t.Fatalf("a write that succeeds at once: %v, logged %q; want nil and nothing", err, logs)
	}

	full := fmt.Errorf("no space left on device: %w", ledger.ErrWrite)
	attempts := 0
	err := d.durably(ctx, checkpointWrite, func() error {
		if attempts++; attempts <= 2 {
			return full
		}
		return nil
	})
	if err != nil || attempts != 3 {
		t.Fatalf("a write that fails twice: %v after %d attempts, want nil after 3", err, attempts)
	}
	if f := daemontest.GatherCounter(reg, alerts.NameCheckpointFailures); f != 2 {
		t.Errorf("%s %v, want 2", alerts.NameCheckpointFailures, f)
	}
	if g := daemontest.GatherCounter(reg, alerts.NameCheckpointFailing); g != 0 {
		t.Errorf("%s %v once the write succeeded, want 0", alerts.NameCheckpointFailing, g)
	}
	if n := strings.Count(logs.String(), "level=ERROR"); n != 1 {
		t.Errorf("%d ERROR lines for one episode, want 1:\n%s", n, logs)
	}
	if got := logs.Logged("checkpoint written again; consuming resumed", "failed_attempts"); got != "2" {
		t.Errorf("the episode's end logged failed_attempts %q, want 2:\n%s", got, logs)
	}
	if h := d.checkpointHealth(); h != nil {
		t.Errorf("/readyz once the write succeeded: %v", h)
	}

	other := errors.New("the ledger is closed")
	attempts = 0
	if err := d.durably(ctx, checkpointWrite, func() error { attempts++; return other }); !errors.Is(err, other) || attempts != 1 {
		t.Errorf("a write failing with another error: %v after %d attempts, want it returned after 1", err, attempts)
	}
	if f := daemontest.GatherCounter(reg, alerts.NameCheckpointFailures); f != 2 {
		t.Errorf("%s %v after another error, want 2 still", alerts.NameCheckpointFailures, f)
	}

	// A context that ends while the write waits for its retry ends it with the context's error.
	cctx, cancel := context.WithCancel(ctx)
	err = d.durably(cctx, shareWrite, func() error { cancel(); return full })
	if !errors.Is(err, context.Canceled) {
		t.Errorf("a write whose context ended during its retry: %v, want context.Canceled", err)
	}
}
