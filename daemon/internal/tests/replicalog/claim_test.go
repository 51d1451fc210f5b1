package replicalog

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/cfguard/cfguard/alerts"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// TestClaimRecordsItsBuildAndGeneration: the claim an updater appends names, for forensics, the
// writer's build (cfguard, OS/GOARCH) and the updater group's generation that gave it the role
// (one of the generations the replica took part in).
func TestClaimRecordsItsBuildAndGeneration(t *testing.T) {
	t.Parallel() // mostly waits for its replica
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	waitfor.Cond(t, 60*time.Second, "r1 in a term it claimed", func() bool { return r.D.Replica().Head().Term > 0 })
	h := r.D.Replica().Head()
	rd, err := daemontest.KeyHolderLog(t, r).Read(0)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var claim *postlog.Entry
	for claim == nil {
		rec, err := rd.Next(ctx)
		if err != nil {
			t.Fatalf("reading the log for the claim of term %d: %v", h.Term, err)
		}
		if e, err := postlog.Decode(rec.Value); err == nil && e.Kind == postlog.Claim && e.Term == h.Term {
			claim = e
		}
	}
	if claim.Writer != h.Writer {
		t.Errorf("the claim of term %d names writer %q, want %q", h.Term, claim.Writer, h.Writer)
	}
	if want := runtime.GOOS + "/" + runtime.GOARCH; !strings.HasPrefix(claim.Build, "cfguard ") || !strings.Contains(claim.Build, want) {
		t.Errorf("the claim's build is %q, want cfguard's version and %s", claim.Build, want)
	}
	if gens := r.Metric(t, alerts.NameGenerations); claim.Generation < 1 || float64(claim.Generation) > gens {
		t.Errorf("the claim names generation %d; want one of the %v generations r1 took part in", claim.Generation, gens)
	}
}
