package replicalog

import (
	"github.com/cfguard/cfguard/cmd/cfguard/internal/command"
	"github.com/cfguard/cfguard/cmd/cfguard/internal/proc"

	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// The runbook's recovery, as written (docs/RUNBOOK.md, "CfguardPosteriorLogStopped"): two
// replica processes stop on an authenticated entry of an unknown format (what a newer build
// would write) while records keep arriving; `cfguard new-epoch` refuses without the cluster key
// and on a log that follows, then writes the next epoch; the stopped replicas resume without a
// restart, agree on one posterior, and the log covers every record produced exactly once (its
// coverage equals the records produced per partition, and verify-log re-executes every
// increment from its records). Then --force moves the log, not stopped, to a second epoch, and
// the replicas follow it too.
func TestNewEpochResumesStoppedReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("replica processes and a stream: not with -short")
	}
	c := proc.StreamingReplicas(t)
	brokers, root, modelDir, data, reps, s := c.Brokers, c.Root, c.ModelDir, c.Data, c.Reps, c.Stream
	produced := s.End(t)
	before := proc.WaitAgree(t, "before the unreadable entry", reps, produced)

	// Refusals: a log that follows (without --force), another key file.
	if code, _, errs := proc.RunCLI(t, "new-epoch", "--config", reps[0].Config); code == 0 || !strings.Contains(errs, "the replicas are not stopped") {
		t.Fatalf("new-epoch on a log that follows: exit %d, %s", code, errs)
	}
	otherRoot := t.TempDir()
	otherDir := filepath.Join(otherRoot, "x")
	if err := os.MkdirAll(otherDir, 0o755); err != nil {
		t.Fatal(err)
	}
	wrongKey := proc.WriteReplicaConfig(t, otherDir, "x", brokers, modelDir)
	if code, _, errs := proc.RunCLI(t, "new-epoch", "--config", wrongKey, "--force"); code == 0 || !strings.Contains(errs, "authenticates under the keys of replication.key_file") {
		t.Fatalf("new-epoch with another key file: exit %d, %s", code, errs)
	}

	// An authenticated entry of format 2 on the head, covering 16 more records per partition.
	keys, err := clusterkey.Load(proc.ClusterKey(t, root))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	plog, err := postlog.Open(ctx, stream.ConnConfig{Brokers: brokers}, "cfguard.posterior", keys, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer plog.Close()
	covers := map[int]int64{}
	for p, to := range before.Replication.Covers {
		covers[p] = to + 16
	}
	newer, err := json.Marshal(map[string]any{"format": postlog.Format + 1, "kind": "increment", "seq": before.Replication.Entry + 1,
		"term": before.Replication.Term, "writer": "r9/newer", "covers": covers, "posterior_sha256": before.Replication.SHA})
	if err != nil {
		t.Fatal(err)
	}
	end, err := plog.End(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := plog.Append(ctx, "newer", newer); err != nil {
		t.Fatal(err)
	}
	unreadable := offsetOf(t, plog, end, newer)
	for _, r := range reps {
		waitfor.Cond(t, 60*time.Second, r.ID+" stopped", func() bool {
			v, ok := r.View()
			return ok && strings.Contains(v.Replication.Stopped, "upgrade cfguard") && strings.Contains(v.Replication.Stopped, fmt.Sprintf("offset %d", unreadable))
		})
	}
	// Records keep arriving while the replicas are stopped. The updater reads them, finds the
	// log stopped, appends nothing, and keeps its role (and the group its generation) until the
	// new epoch: no new generation of the updater group while the log is stopped.
	const keeping = "updater: the posterior log stopped; keeping the updater role"
	generations := func() (n int) {
		for _, r := range reps {
			n += strings.Count(r.Child.Log.String(), "updater group: new generation")
		}
		return n
	}
	stoppedGenerations := generations()
	s = proc.StartStream(brokers, data)
	waitfor.Cond(t, 60*time.Second, "records produced while stopped", func() bool {
		s.Mu.Lock()
		defer s.Mu.Unlock()
		return s.Produced >= 64
	})
	produced += s.End(t)
	waitfor.Cond(t, 60*time.Second, "the updater keeps its role while the log is stopped", func() bool {
		for _, r := range reps {
			if strings.Contains(r.Child.Log.String(), keeping) {
				return true
			}
		}
		return false
	})
	if n := generations(); n != stoppedGenerations {
		t.Errorf("the updater group went through %d generations while the log was stopped, want 0", n-stoppedGenerations)
	}
	if end, err := plog.End(ctx); err != nil || end != unreadable+1 {
		t.Errorf("the posterior log ends at %d (%v) while stopped at offset %d: the updater appended on a stopped log", end, err, unreadable)
	}
	// Every replica counts the records the stopped log has not covered as waiting
	// (CfguardIngestStalled), whichever of them reads the topic.
	waiting := float64(int64(produced) - proc.Covered(before))
	for _, r := range reps {
		waitfor.Cond(t, 60*time.Second, fmt.Sprintf("%s: cfguard_consumer_lag_records = %v records not covered", r.ID, waiting), func() bool {
			v, ok := r.Metric("cfguard_consumer_lag_records")
			return ok && v == waiting
		})
	}

	// The runbook's commands for a stopped replica, as written, in that state.
	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "/readyz", Want: fmt.Sprintf(`^\{"error":"not following the posterior log: .*unknown format.*upgrade cfguard \(offset %d of cfguard\.posterior`, unreadable)},
			{Cmd: "jq .replication", Want: fmt.Sprintf(`(?s)"entry": \d+,.*"posterior_sha256": "%s".*"stopped": ".*unknown format.*offset %d of cfguard\.posterior`, before.Replication.SHA, unreadable)},
			{Cmd: "kcat -C", Want: fmt.Sprintf(`(?m)^%d \S+ \d+ bytes$`, unreadable)},
		}
		s := runbooktest.Named(t, filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md"), "CfguardPosteriorLogStopped")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", reps[0].Child.Addr(), "BROKER", brokers[0]), nil)
	}

	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", reps[1].Config)
	var rep command.EpochReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil || code != 0 {
		t.Fatalf("new-epoch: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	if rep.Epoch != 1 || rep.MovedPast == nil || rep.MovedPast.Offset != unreadable || !strings.Contains(rep.Stopped, "unknown format") ||
		rep.PosteriorSHA256 != before.Replication.SHA || rep.Offset <= unreadable {
		t.Fatalf("new-epoch's report %+v; want epoch 1 past offset %d with the head's posterior %s", rep, unreadable, before.Replication.SHA)
	}
	// They resume from it, without a restart, and cover every record once.
	after := proc.WaitAgree(t, "after the new epoch", reps, produced)
	for p, to := range after.Replication.Covers {
		if to < before.Replication.Covers[p] {
			t.Fatalf("partition %d covered to %d after the epoch, %d before", p, to, before.Replication.Covers[p])
		}
	}
	for _, r := range reps {
		if v, _ := r.View(); v.Replication.Stopped != "" {
			t.Fatalf("%s still stopped: %s", r.ID, v.Replication.Stopped)
		}
	}
	if after.Replication.Term <= before.Replication.Term || after.Version <= before.Version {
		t.Fatalf("after the epoch: term %d, version %d; before: term %d, version %d (no new updater, or no update)",
			after.Replication.Term, after.Version, before.Replication.Term, before.Version)
	}
	proc.VerifyLog(t, reps[0].Config, -1)
	t.Logf("new epoch at offset %d past offset %d; %d records covered once, posterior %s", rep.Offset, unreadable, produced, after.Replication.SHA)

	// On a log that follows, --force writes the next epoch past the head: the replicas, not
	// stopped, move to it, a new term is claimed, and the records produced after it are covered
	// once too.
	code, out, errs = proc.RunCLI(t, "new-epoch", "--config", reps[0].Config, "--force")
	var forced command.EpochReport
	if err := json.Unmarshal([]byte(out), &forced); err != nil || code != 0 {
		t.Fatalf("new-epoch --force: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	if forced.Epoch != 2 || forced.Stopped != "" || forced.MovedPast == nil || forced.MovedPast.Offset <= rep.Offset ||
		forced.PosteriorSHA256 != after.Replication.SHA {
		t.Fatalf("new-epoch --force's report %+v; want epoch 2 past the head, with the posterior %s", forced, after.Replication.SHA)
	}
	s = proc.StartStream(brokers, data)
	waitfor.Cond(t, 60*time.Second, "records produced after the forced epoch", func() bool {
		s.Mu.Lock()
		defer s.Mu.Unlock()
		return s.Produced >= 64
	})
	produced += s.End(t)
	final := proc.WaitAgree(t, "after the forced epoch", reps, produced)
	if final.Replication.Entry <= forced.Seq || final.Replication.Term <= after.Replication.Term {
		t.Fatalf("after the forced epoch (entry %d): entry %d, term %d; before it: term %d", forced.Seq, final.Replication.Entry,
			final.Replication.Term, after.Replication.Term)
	}
	proc.VerifyLog(t, reps[0].Config, -1)
}

// offsetOf finds the offset of the record whose value is value, at or after from.
func offsetOf(t *testing.T, plog *postlog.Log, from int64, value []byte) int64 {
	t.Helper()
	rd, err := plog.Read(from)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		rec, err := rd.Next(ctx)
		if err != nil {
			t.Fatalf("looking for the appended record from offset %d: %v", from, err)
		}
		if string(rec.Value) == string(value) {
			return rec.Offset
		}
	}
}

// Without the cluster key there is no epoch any replica would accept: new-epoch refuses before
// it connects, naming the key.
func TestNewEpochRefusesWithoutAKey(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(p, []byte("kafka:\n  brokers: [127.0.0.1:1]\nreplication:\n  enabled: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, _, errs := proc.RunCLI(t, "new-epoch", "--config", p)
	if code == 0 || !strings.Contains(errs, "replication.key_file") {
		t.Fatalf("new-epoch without a key file: exit %d, %s", code, errs)
	}
	if code, _, errs := proc.RunCLI(t, "new-epoch", "--config", p, "--force"); code == 0 || !strings.Contains(errs, "replication.key_file") {
		t.Fatalf("new-epoch --force without a key file: exit %d, %s", code, errs)
	}
}

// The runbook's recovery from a reset log (docs/RUNBOOK.md, "CfguardPosteriorLogStopped", "A
// reset log"): the posterior topic is deleted and recreated under two replica processes while
// records keep arriving. Both stop following (the log ends before what they read), serving the
// posterior they had. `cfguard new-epoch --head-from` writes, from one replica's head and
// posterior, a new epoch that begins the recreated log; both replicas resume from it without a
// restart, cover every record produced once (none skipped, none applied twice), a third replica
// started on an empty state_dir begins from the epoch and agrees, and verify-log re-executes the
// log from it.
func TestNewEpochRebuildsARecreatedLog(t *testing.T) {
	if testing.Short() {
		t.Skip("replica processes and a stream: not with -short")
	}
	c := proc.StreamingReplicas(t)
	produced := c.Stream.End(t)
	before := proc.WaitAgree(t, "before the reset", c.Reps, produced)

	kafkatest.RecreateTopic(t, c.Brokers, "cfguard.posterior", 1)
	s := proc.StartStream(c.Brokers, c.Data)
	waitfor.Cond(t, 60*time.Second, "records produced after the reset", func() bool {
		s.Mu.Lock()
		defer s.Mu.Unlock()
		return s.Produced >= 64
	})
	produced += s.End(t)
	for _, r := range c.Reps {
		var v proc.ModelView
		waitfor.Cond(t, 60*time.Second, r.ID+" stops on the reset log", func() bool {
			var ok bool
			v, ok = r.View()
			return ok && strings.Contains(v.Replication.Stopped, "posterior log reset")
		})
		if v.Replication.Entry != before.Replication.Entry || v.Replication.SHA != before.Replication.SHA {
			t.Fatalf("%s after the reset: entry %d (%s); want what it had, entry %d (%s)", r.ID, v.Replication.Entry, v.Replication.SHA,
				before.Replication.Entry, before.Replication.SHA)
		}
	}
	// Without --head-from there is nothing to move past: the log holds no genesis.
	if code, _, errs := proc.RunCLI(t, "new-epoch", "--config", c.Reps[0].Config, "--force"); code == 0 || !strings.Contains(errs, "holds no genesis") {
		t.Fatalf("new-epoch on the recreated log without --head-from: exit %d, %s", code, errs)
	}
	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", c.Reps[1].Config, "--head-from", "http://"+c.Reps[0].Child.Addr())
	var rep command.EpochReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil || code != 0 {
		t.Fatalf("new-epoch --head-from: exit %d, %v\n%s\n%s", code, err, out, errs)
	}
	if rep.Epoch != 1 || rep.Seq != before.Replication.Entry+1 || rep.PosteriorSHA256 != before.Replication.SHA || rep.Version != before.Version ||
		!maps.Equal(rep.Covers, before.Replication.Covers) {
		t.Fatalf("new-epoch --head-from's report %+v; want epoch 1, entry %d, the head's posterior %s (version %d) and coverage %v",
			rep, before.Replication.Entry+1, before.Replication.SHA, before.Version, before.Replication.Covers)
	}
	after := proc.WaitAgree(t, "after the new epoch", c.Reps, produced)
	if after.Replication.Term <= before.Replication.Term || after.Version <= before.Version {
		t.Fatalf("after the epoch: term %d, version %d; before: term %d, version %d (no new updater, or no update)",
			after.Replication.Term, after.Version, before.Replication.Term, before.Version)
	}
	// A replica that never saw the old log begins from the epoch.
	dir := filepath.Join(c.Root, "r3")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	r3 := &proc.ReplicaProc{ID: "r3", Dir: dir, Config: proc.WriteReplicaConfig(t, dir, "r3", c.Brokers, c.ModelDir)}
	r3.Start(t)
	proc.WaitAgree(t, "with a replica begun from the epoch", append(c.Reps, r3), produced)
	proc.VerifyLog(t, c.Reps[0].Config, -1)
}

// verify-log and new-epoch read or write a replicated deployment's posterior log: a
// configuration of a single daemon (the embedded broker, or brokers without replication) is a
// usage error (exit 2) naming the file, before any connection.
func TestLogCommandsRefuseASingleDaemonsConfig(t *testing.T) {
	dir := t.TempDir()
	for name, body := range map[string]string{"embedded": "state_dir: " + dir + "\n", "no replication": "kafka:\n  brokers: [127.0.0.1:1]\n"} {
		p := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, cmd := range []string{"verify-log", "new-epoch"} {
			if code, _, errs := proc.RunCLI(t, cmd, "--config", p); code != 2 || !strings.Contains(errs, p+" is not a replica's configuration") {
				t.Errorf("%s, configuration %q: exit %d, %s; want 2 naming the file", cmd, name, code, errs)
			}
		}
	}
}

// runNewEpoch runs new-epoch on l's log with args after --config and decodes its report; it
// fails the test unless new-epoch exits 0.
func (l *testLog) runNewEpoch(args ...string) command.EpochReport {
	l.t.Helper()
	code, out, errs := proc.RunCLI(l.t, append([]string{"new-epoch", "--config", l.config}, args...)...)
	var ep command.EpochReport
	if err := json.Unmarshal([]byte(out), &ep); code != 0 || err != nil {
		l.t.Fatalf("new-epoch %v: exit %d, %v\n%s\n%s", args, code, err, out, errs)
	}
	return ep
}

// An authenticated record of an unknown format stops the replicas: verify-log lists it under
// stopped and under ignored, and exits 1 naming its offset; a record that does not authenticate
// before it does not keep new-epoch from moving past it. After the epoch verify-log follows the
// log to the epoch and exits 0.
func TestNewEpochMovesPastAnUnreadableRecord(t *testing.T) {
	l := newTestLog(t)
	head := l.seq
	l.append(l.inc(0), false) // offset 2: not authenticated, ignored
	newer, err := json.Marshal(map[string]any{"format": postlog.Format + 1, "kind": "increment", "seq": head + 1, "term": 1, "writer": "r9/newer"})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.plog.Append(context.Background(), "newer", newer); err != nil { // offset 3
		t.Fatal(err)
	}
	code, rep, errs := l.verify()
	if code != 1 || !strings.Contains(errs, "the replicas are stopped at offset 3 of cfguard.posterior") {
		t.Errorf("verify-log on the stopped log: exit %d, %s; want 1, naming offset 3", code, errs)
	}
	if len(rep.Stopped) != 1 || rep.Stopped[0].Offset != 3 || !strings.Contains(rep.Stopped[0].Why, "unknown format") ||
		rep.Ignored["unknown_format"] != 1 || rep.Ignored["unauthenticated"] != 1 {
		t.Errorf("stopped %+v, ignored %v; want the record at offset 3, of an unknown format, and one unauthenticated", rep.Stopped, rep.Ignored)
	}
	ep := l.runNewEpoch()
	if ep.Epoch != 1 || ep.Seq != head+1 || ep.MovedPast == nil || ep.MovedPast.Offset != 3 || !strings.Contains(ep.Stopped, "unknown format") ||
		ep.PosteriorSHA256 != l.sha || ep.Offset != 4 {
		t.Fatalf("new-epoch wrote %+v; want epoch 1, entry %d at offset 4, past offset 3, with the head's posterior %s", ep, head+1, l.sha)
	}
	code, rep, errs = l.verify()
	if code != 0 || rep.Head == nil || rep.Head.Seq != head+1 || rep.Head.Epoch != 1 || rep.Head.Offset != 4 || len(rep.Stopped) != 1 {
		t.Errorf("verify-log after the epoch: exit %d, head %+v, stopped %+v\n%s; want 0, the epoch as the head", code, rep.Head, rep.Stopped, errs)
	}
}

// The settings a new epoch records are the log genesis's, whatever --config holds; a log whose
// genesis records none gets the file's. verify-log re-executes with those the last genesis
// records and says which genesis that is.
func TestNewEpochCarriesTheLogsSettings(t *testing.T) {
	for _, tc := range []struct {
		name     string
		settings map[string]string // the first genesis's
		from     string            // EpochReport.Settings
		differ   []string          // the keys the epoch's settings change from the file's
	}{
		{"the genesis's", map[string]string{"update.kl_weight": "2"}, "the log's genesis at offset 0", []string{"update.kl_weight"}},
		{"none: the file's", nil, "file", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newTestLogWith(t, func(g *postlog.Entry) { g.Settings = tc.settings })
			l.accept(l.inc(0))
			if _, rep, _ := l.verify(); (tc.settings == nil) != (rep.Settings.From == "file") {
				t.Errorf("verify-log before the epoch: settings %+v; want the genesis's when it records some, else the file's", rep.Settings)
			}
			ep := l.runNewEpoch("--force")
			if ep.Settings != tc.from {
				t.Errorf("new-epoch's settings: %q, want %q", ep.Settings, tc.from)
			}
			code, rep, errs := l.verify()
			if want := fmt.Sprintf("genesis at offset %d", ep.Offset); code != 0 || rep.Settings.From != want || !slices.Equal(rep.Settings.DifferFromFile, tc.differ) {
				t.Errorf("verify-log after the epoch: exit %d, settings %+v\n%s; want %s, differing from the file in %v", code, rep.Settings, errs, want, tc.differ)
			}
		})
	}
}

// A log that begins with a later epoch (a recreated topic, begun by new-epoch --head-from)
// brings its posterior in that epoch: verify-log re-executes the increments after it, and
// new-epoch writes the next epoch with it.
func TestNewEpochOnALogBegunByALaterEpoch(t *testing.T) {
	past := strings.Repeat("ab", 32)
	l := newTestLogWith(t, func(g *postlog.Entry) {
		g.Seq, g.Epoch, g.Parent, g.Past = 5, 1, past, &postlog.Past{Offset: 9, SHA256: past}
	})
	l.accept(l.inc(0))
	code, rep, errs := l.verify()
	if code != 0 || rep.Increments != 1 || rep.Matched != 1 || rep.Head == nil || rep.Head.Epoch != 1 {
		t.Fatalf("verify-log: exit %d, %d re-executed, %d matched, head %+v\n%s; want 0 and the increment matched", code, rep.Increments, rep.Matched, rep.Head, errs)
	}
	ep := l.runNewEpoch("--force")
	if ep.Epoch != 2 || ep.Seq != 8 || ep.PosteriorSHA256 != l.sha || ep.MovedPast == nil || ep.MovedPast.Offset != 2 {
		t.Fatalf("new-epoch --force wrote %+v; want epoch 2, entry 8, past the head at offset 2, with the posterior %s", ep, l.sha)
	}
}

// An increment whose recorded last layer does not hash to its posterior_sha256 stops the
// replicas: verify-log lists it under stopped and exits 1 naming its offset; new-epoch finds it
// without --force and moves past it, after its parent; verify-log then follows the log to the
// epoch and exits 0.
func TestNewEpochMovesPastAPosteriorThatDoesNotHash(t *testing.T) {
	l := newTestLog(t)
	head := l.seq
	m := l.model.Clone()
	m.Last().WeightMu[0] += 0.5
	e := l.inc(0)
	e.Outcome, e.Version, e.LastLayer = postlog.Promoted, 1, postlog.LastLayerOf(m) // posterior_sha256 stays the genesis's
	l.accept(e)
	stopped := func(rep command.VerifyReport) bool {
		return len(rep.Stopped) == 1 && rep.Stopped[0].Offset == 2 && strings.Contains(rep.Stopped[0].Why, "posterior does not match its entry") &&
			rep.Ignored["posterior_mismatch"] == 1
	}
	code, rep, errs := l.verify()
	if code != 1 || !strings.Contains(errs, "the replicas are stopped at offset 2 of cfguard.posterior") || !stopped(rep) || rep.Head == nil || rep.Head.Seq != head {
		t.Errorf("verify-log on the stopped log: exit %d, stopped %+v, ignored %v, head %+v\n%s; want 1, the entry at offset 2 stopped, the head before it",
			code, rep.Stopped, rep.Ignored, rep.Head, errs)
	}
	ep := l.runNewEpoch()
	if ep.Epoch != 1 || ep.Seq != head+1 || ep.MovedPast == nil || ep.MovedPast.Offset != 2 || !strings.Contains(ep.Stopped, fmt.Sprintf("entry %d:", head+1)) ||
		ep.PosteriorSHA256 != l.sha {
		t.Fatalf("new-epoch wrote %+v; want epoch 1, entry %d past offset 2, naming the entry that does not hash", ep, head+1)
	}
	code, rep, errs = l.verify()
	if code != 0 || !stopped(rep) || rep.Head == nil || rep.Head.Seq != head+1 || rep.Head.Epoch != 1 {
		t.Errorf("verify-log after the epoch: exit %d, stopped %+v, head %+v\n%s; want 0, the epoch as the head", code, rep.Stopped, rep.Head, errs)
	}
}

// replicaAPI serves, as a replica's API does, l's head (its last entry, in term 1 at offset 2)
// with the entry number entry gives (served: whether this server has served the posterior yet)
// and l's posterior, to requests that carry token ("" for none). It stops with the test.
func replicaAPI(t *testing.T, l *testLog, token string, entry func(served bool) uint64) *httptest.Server {
	t.Helper()
	sidecar, weights, err := bnn.Encode(l.model)
	if err != nil {
		t.Fatal(err)
	}
	h := postlog.Hash(l.prev)
	var served atomic.Bool
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if token != "" && r.Header.Get("Authorization") != "Bearer "+token {
			http.Error(w, "no token", http.StatusUnauthorized)
			return
		}
		switch r.URL.Path {
		case "/v1/model":
			fmt.Fprintf(w, `{"posterior_version":%d,"replication":{"entry":%d,"term":1,"offset":2,"hash":"%s","posterior_sha256":"%s","covers":{"0":0}}}`,
				l.model.Version, entry(served.Load()), hex.EncodeToString(h[:]), l.sha)
		case "/v1/model/posterior/sidecar":
			w.Write(sidecar)
		case "/v1/model/posterior":
			w.Write(weights)
			served.Store(true)
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(api.Close)
	return api
}

// new-epoch --head-from is for a log that no longer holds the replica's head: on a log that holds
// an entry as far as the replica's head it refuses and writes nothing. It asks the replica's API
// with http.token of --config.
func TestNewEpochHeadFromRefusesALogThatHoldsTheHead(t *testing.T) {
	l := newTestLog(t)
	l.accept(l.inc(0))
	const token = "replica-token"
	api := replicaAPI(t, l, token, func(bool) uint64 { return l.seq })
	proc.EditConfig(t, l.config, "log:\n", "http:\n  token: "+token+"\nlog:\n")
	ctx := context.Background()
	end, err := l.plog.End(ctx)
	if err != nil {
		t.Fatal(err)
	}
	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", l.config, "--head-from", api.URL)
	if code == 0 || !strings.Contains(errs, fmt.Sprintf("holds entry %d at offset 2, as far as the head of the replica at %s (entry %d): the log did not lose it", l.seq, api.URL, l.seq)) {
		t.Errorf("new-epoch --head-from on a log that holds the head: exit %d\n%s\n%s; want a refusal", code, out, errs)
	}
	if after, err := l.plog.End(ctx); err != nil || after != end {
		t.Errorf("the log ends at %d (%v) after the refusal, at %d before: it wrote", after, err, end)
	}
}

// new-epoch --head-from exits 0 only once the replica at --head-from reports the new epoch as
// its head: an epoch that the replica never takes (written with a key file that is not the
// cluster's, say) is written, but the command fails after --wait, naming the offset and what to
// check. A replica that resumes from the epoch ends the wait at once.
func TestNewEpochHeadFromWaitsForTheReplica(t *testing.T) {
	l := newTestLog(t)
	l.accept(l.inc(0))
	api := replicaAPI(t, l, "", func(bool) uint64 { return l.seq })

	kafkatest.RecreateTopic(t, l.b.Addrs(), "cfguard.posterior", 1) // the log lost the replica's head
	code, out, errs := proc.RunCLI(t, "new-epoch", "--config", l.config, "--head-from", api.URL, "--wait", "2s")
	if want := fmt.Sprintf("the new epoch was written at offset 0, but the replica at %s did not resume from it within 2s", api.URL); code != 1 ||
		!strings.Contains(errs, want) || !strings.Contains(errs, "check that replication.key_file of "+l.config+" is the cluster's") {
		t.Fatalf("new-epoch --head-from with a replica that does not resume: exit %d\n%s\n%s; want 1 and %q", code, out, errs, want)
	}

	kafkatest.RecreateTopic(t, l.b.Addrs(), "cfguard.posterior", 1)
	api = replicaAPI(t, l, "", func(served bool) uint64 {
		if served { // new-epoch read the head, then wrote the epoch, which this replica applies
			return l.seq + 1
		}
		return l.seq
	})
	rep := l.runNewEpoch("--head-from", api.URL)
	if rep.Epoch != 1 || rep.Seq != l.seq+1 || rep.Offset != 0 {
		t.Fatalf("new-epoch --head-from with a replica that resumes: %+v; want epoch 1, entry %d at offset 0", rep, l.seq+1)
	}
	if code, _, errs := proc.RunCLI(t, "new-epoch", "--config", l.config, "--head-from", api.URL, "--wait", "0s"); code != 2 || !strings.Contains(errs, "--wait 0s") {
		t.Errorf("new-epoch --wait 0s: exit %d, %s; want 2 naming the flag", code, errs)
	}
}
