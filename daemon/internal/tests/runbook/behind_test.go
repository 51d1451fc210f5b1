package runbook

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestRunbookOfRenewalsBehindAndRecordsLost runs the commands of docs/RUNBOOK.md's sections whose
// state takes a daemon of its own (daemontest.RunbookOwnState), as TestRunbookCommandsRun runs
// the others: CfguardRenewalBehind's against a daemon whose
// confirmers are held after a drift lapsed its certificates (behindDaemon), whose backlog empties
// once they are released; CfguardRecordsLost's against a daemon whose input records were deleted
// by retention before it read them (lostDaemon).
func TestRunbookOfRenewalsBehindAndRecordsLost(t *testing.T) {
	t.Parallel() // mostly waits for its daemons to reach their states and for the commands
	runbooktest.Tools(t, false)
	path := daemontest.RunbookPath(t)
	behind, release := behindDaemon(t)
	lost, _ := lostDaemon(t)
	for name := range daemontest.RunbookOwnState {
		s := runbooktest.Named(t, path, name)
		runbooktest.Covered(t, s, daemontest.RunbookChecks[name])
		switch name {
		case "CfguardRenewalBehind":
			behind.Run(t, s)
		case "CfguardRecordsLost":
			lost.Run(t, s)
		default:
			t.Errorf("%s: no state for it here", name)
		}
	}
	// CfguardRenewalBehind's condition ends once the confirmers get the CPU they lacked: the
	// backlog empties, each lapsed certificate renewed or judged.
	release()
	waitfor.Cond(t, 60*time.Second, "the renewal backlog to empty once the confirmers run", func() bool {
		return behind.R.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0
	})
}

// behindDaemon is a daemon whose confirmers are held before their first round, as a starved CPU
// holds them, while flipped records lapse the certificates of its 8 CEs: the renewal backlog
// stays (CfguardRenewalBehind), its CEs certified with renewal_pending. release lets the
// confirmers run.
func behindDaemon(t *testing.T) (st *state, release func()) {
	t.Helper()
	held := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(held) }) }
	t.Cleanup(release)
	r := launch.With(t, daemontest.WithSharedVAE(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) }), func(o *daemon.Options) {
		o.Hooks.ConfirmRound = func(ctx context.Context) {
			select {
			case <-held:
			case <-ctx.Done():
			}
		}
	}, nil)
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 8, "")
	r.Produce(t, daemontest.Flipped(data, 128)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and certificates lapsed, waiting for the confirmers", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == 128 && r.Metric(t, "cfguard_counterfactuals_renewal_pending") > 0
	})
	return &state{R: r, Subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.Config.StateDir),
	)}, release
}
