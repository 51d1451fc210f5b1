package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/cluster"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// An audit does not run over the share of a replica paused past the CE group's session until
// the share has settled: the group may have given its partitions to another replica, which
// judged and published their CEs meanwhile. r1's member sees its clock jump a minute (a pause,
// as SIGSTOP makes one; the group does not evict r1, whose heartbeats go on). Right after it,
// POST /v1/audit, the same request forwarded by another replica, and a scheduled audit each
// wait their AuditRebuildWait and answer 503 with Retry-After (the scheduled one ErrRebuilding),
// and no audit runs; once r1's generation has gone on for a session timeout, the share settles
// and the audit runs over every CE r1 holds.
func TestAuditWaitsForTheShareToSettleAfterAPause(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica, a pause and a session timeout: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	var skew atomic.Int64 // how far r1's member's clock is ahead of time.Now
	const wait = time.Second
	r1 := startDaemonWith(t, func(c *config.Config) { daemontest.ReplicaConfig(c, b.Addrs(), "r1", key) }, func(o *Options) {
		o.Hooks.CEClock = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
		o.Hooks.AuditRebuildWait = wait
	}, nil)
	share := func() *cluster.Share { return r1.D.share }
	waitfor.Cond(t, 60*time.Second, "r1 ready, owning every CE partition", func() bool {
		code, _ := r1.Get(t, "/readyz")
		return code == 200 && daemontest.ShareReady(r1) && len(share().Member().Owned()) == share().Partitions()
	})
	ids := daemontest.RegisterCEs(t, r1, daemontest.Bundled(t), 6, "")
	gen := share().Member().Generation()
	session := r1.D.cfg.Replication.SessionTimeout

	skew.Store(int64(time.Minute)) // the member's next look at its clock finds a pause of a minute
	paused := time.Now()
	select {
	case <-share().Settled():
		t.Fatal("the share is settled right after a pause past the session: the test shows nothing")
	default:
	}

	type answer struct {
		code       int
		retryAfter string
		body       string
		err        error
	}
	post := func(header map[string]string) answer {
		req, err := http.NewRequest(http.MethodPost, r1.Base+"/v1/audit", strings.NewReader("{}"))
		if err != nil {
			return answer{err: err}
		}
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := r1.Client.Do(req)
		if err != nil {
			return answer{err: err}
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		return answer{code: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), body: string(body), err: err}
	}
	var (
		wg                sync.WaitGroup
		api, forwarded    answer
		scheduledErr      error
		scheduledAnswered time.Time
	)
	wg.Go(func() { api = post(nil) })
	wg.Go(func() { forwarded = post(map[string]string{cluster.HeaderForwarded: "r2"}) })
	wg.Go(func() {
		_, scheduledErr = r1.D.runAudit(context.Background(), "schedule")
		scheduledAnswered = time.Now()
	})
	wg.Wait()
	if took := time.Since(paused); took >= session {
		t.Fatalf("the audits answered %v after the pause, past the session timeout %v that settles the share: the test shows nothing", took, session)
	}
	for name, a := range map[string]answer{"POST /v1/audit": api, "POST /v1/audit forwarded by another replica": forwarded} {
		if a.err != nil {
			t.Fatalf("%s: %v", name, a.err)
		}
		if a.code != http.StatusServiceUnavailable || a.retryAfter == "" || !strings.Contains(a.body, "paused past") {
			t.Errorf("%s right after a pause past the session: %d (Retry-After %q) %s; want 503 with Retry-After saying the replica "+
				"was paused past its session", name, a.code, a.retryAfter, a.body)
		}
	}
	if !errors.Is(scheduledErr, cluster.ErrRebuilding) {
		t.Errorf("a scheduled audit right after a pause past the session: %v; want ErrRebuilding", scheduledErr)
	}
	if waited := scheduledAnswered.Sub(paused); waited < wait {
		t.Errorf("the scheduled audit answered %v after the pause, before its wait of %v", waited, wait)
	}
	if st := r1.D.auditStatus(); st.Running || st.LastFinished != nil {
		t.Errorf("an audit ran right after a pause past the session: %+v", st)
	}
	if got := r1.Metric(t, alerts.NameAudits); got != 0 {
		t.Errorf("%s %v right after a pause past the session, want 0", alerts.NameAudits, got)
	}

	// The group did not evict r1: once its generation has gone on for a session timeout, the
	// share settles and the audit covers every CE it holds.
	select {
	case <-share().Settled():
	case <-time.After(3 * session):
		t.Fatalf("the share is not settled %v after the pause, its generation %d still r1's (now %d)", 3*session, gen, share().Member().Generation())
	}
	if got := share().Member().Generation(); got != gen {
		t.Fatalf("r1's generation went from %d to %d: the group rebalanced, the test shows nothing of a generation that goes on", gen, got)
	}
	a := post(nil)
	if a.err != nil || a.code != http.StatusOK {
		t.Fatalf("POST /v1/audit once the share settled: %d %s (%v)", a.code, a.body, a.err)
	}
	var rep ledger.AuditReport
	if err := json.Unmarshal([]byte(a.body), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Evaluated != len(ids) {
		t.Errorf("the audit once the share settled evaluated %d CEs, want the %d r1 holds", rep.Evaluated, len(ids))
	}
}
