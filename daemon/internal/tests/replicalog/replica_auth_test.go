package replicalog

import (
	"context"
	"encoding/hex"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// warnedAt reports whether logs hold a WARN line with msg naming offset (and each of also).
func warnedAt(logs, msg string, offset int64, also ...string) bool {
	attr := fmt.Sprintf(" offset=%d ", offset)
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, "level=WARN") && strings.Contains(line, msg) && strings.Contains(line+" ", attr) && containsAll(line, also) {
			return true
		}
	}
	return false
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// TestForgedRecordsAreRefusedByEveryReplica forges, as a client without the cluster key, what
// would otherwise make every replica skip records for good or take a CE away: an increment on
// the last accepted entry naming the current updater, "skipped", covering 500 more offsets per
// partition (without an authenticator, and under another key with the cluster's key id; signed
// with the cluster's key, it is refused for its coverage); a claim
// of a writer outside the group; a deletion of a stored CE and a registration; and, signed with
// the cluster's key, an increment of another log past the head, which would stop every follower
// were it not for the genesis it names. Every replica
// ignores each, counts it, and logs a WARN line naming its offset; the real updater goes on and
// the log covers exactly the records produced. The replicas are mid-rotation (r3 signs with a
// new key k2 that r1 and r2 hold second), and a replica whose key file holds neither key cannot
// join, nor restart on a ledger it built under the cluster's key.
func TestForgedRecordsAreRefusedByEveryReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("three daemons: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	const k2 = "k2:c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3"
	b := daemontest.StartCluster(t, 2)
	// r3 first: it writes the genesis, signed with k2, which r1 and r2 verify with their second key.
	r3 := launch.ReplicaKey(t, b, "r3", daemontest.WriteKeyFile(t, k2, daemontest.ClusterKey))
	r1 := launch.ReplicaKey(t, b, "r1", daemontest.WriteKeyFile(t, daemontest.ClusterKey, k2))
	r2 := launch.ReplicaKey(t, b, "r2", daemontest.WriteKeyFile(t, daemontest.ClusterKey, k2))
	reps := []*launch.Running{r1, r2, r3}
	data := daemontest.Bundled(t)
	produced := 0
	agree := func() daemontest.ModelView {
		var first daemontest.ModelView
		waitfor.Cond(t, 90*time.Second, "replicas agree on a head covering every record", func() bool {
			first = reps[0].Model(t)
			covered := int64(0)
			for _, to := range first.Replication.Covers {
				covered += to
			}
			if covered != int64(produced) {
				return false
			}
			for _, r := range reps[1:] {
				if v := r.Model(t); v.Replication.Entry != first.Replication.Entry || v.Replication.SHA != first.Replication.SHA {
					return false
				}
			}
			return true
		})
		return first
	}
	produced = daemontest.ProduceRows(t, reps[0], data, produced, 64)
	before := agree()
	// Every source of unauthenticated records has its series from the start, at 0: an alert on
	// increase() sees the first one.
	for _, r := range reps {
		for _, src := range []string{"cfguard.posterior", "cfguard.ce", "cfguard.ce.state", "group:cfguard.ce"} {
			if n := r.Metric(t, "cfguard_replication_unauthenticated_total", "topic", src); n != 0 {
				t.Errorf("%s counts %v unauthenticated records of %s before any was forged, want 0", r.Config.Replication.ReplicaID, n, src)
			}
		}
	}
	// CEs registered at each replica: signed with k1 at r1 and r2, with k2 at r3.
	var ids []string
	for _, r := range reps {
		ids = append(ids, daemontest.RegisterCEs(t, r, data, 1, "")...)
	}

	var updater *launch.Running
	for _, r := range reps {
		if r.Model(t).Replication.Updater {
			updater = r
		}
	}
	if updater == nil {
		t.Fatal("no updater")
	}
	h := updater.D.Replica().Head()
	covers := map[int]int64{}
	for p, to := range h.Covers {
		covers[p] = to + 500
	}
	forged := &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: h.Seq + 1, Parent: h.Hash, Term: h.Term, Writer: h.Writer,
		Version: h.Version, ParentVersion: h.Version, InputTopic: "cfguard.records", Covers: covers, Outcome: postlog.Skipped,
		Counts: &postlog.Counts{}, PosteriorSHA256: h.PosteriorSHA256}
	fv, err := forged.Encode()
	if err != nil {
		t.Fatal(err)
	}
	ev, err := daemontest.ClaimOn(h, "evil/deadbeef").Encode()
	if err != nil {
		t.Fatal(err)
	}
	other, err := clusterkey.Parse([]byte("k1:"+hex.EncodeToString([]byte(strings.Repeat("another key, not the cluster's!!", 1)))), "a forger's")
	if err != nil {
		t.Fatal(err)
	}
	const topic = "cfguard.posterior"
	postOffsets := []int64{
		daemontest.RawProduce(t, b, topic, 0, fmt.Sprintf("e/%d", forged.Seq), fv),
		daemontest.RawProduce(t, b, topic, 0, fmt.Sprintf("e/%d", forged.Seq), fv, kafka.Header{Key: clusterkey.Header, Value: postlog.Sign(other, fv)}),
		daemontest.RawProduce(t, b, topic, 0, "evil", ev),
	}
	// The same increment signed with the cluster key (a replica's bug, or a stolen key): it
	// authenticates, and is refused because it covers records that do not exist.
	cluster, err := clusterkey.Parse([]byte(daemontest.ClusterKey), "the cluster's")
	if err != nil {
		t.Fatal(err)
	}
	pastEnd := daemontest.RawProduce(t, b, topic, 0, fmt.Sprintf("e/%d", forged.Seq), fv, kafka.Header{Key: clusterkey.Header, Value: postlog.Sign(cluster, fv)})
	// Signed too, naming the head, but not following from it: a skipped increment that moves the
	// version.
	bad := *forged
	bad.Covers, bad.Version = h.Covers, h.Version+7
	bv, err := bad.Encode()
	if err != nil {
		t.Fatal(err)
	}
	invalid := daemontest.RawProduce(t, b, topic, 0, fmt.Sprintf("e/%d", bad.Seq), bv, kafka.Header{Key: clusterkey.Header, Value: postlog.Sign(cluster, bv)})
	// Signed too, an increment of another log that shares the cluster's key (a staging cluster),
	// numbered past the head's successor: without the genesis it names, every follower would stop
	// as at a diverged chain.
	if h.GenesisHash == "" || h.GenesisHash != before.Replication.Genesis {
		t.Fatalf("the head's genesis %q, GET /v1/model's %q", h.GenesisHash, before.Replication.Genesis)
	}
	foreign := *forged
	foreign.Seq, foreign.Parent, foreign.Covers = h.Seq+3, strings.Repeat("ab", 32), h.Covers
	foreign.Genesis = strings.Repeat("cd", 32)
	xv, err := foreign.Encode()
	if err != nil {
		t.Fatal(err)
	}
	otherLog := daemontest.RawProduce(t, b, topic, 0, fmt.Sprintf("e/%d", foreign.Seq), xv, kafka.Header{Key: clusterkey.Header, Value: postlog.Sign(cluster, xv)})
	// A deletion of a stored CE, and a registration, on the CE topic without an authenticator.
	victim := ids[0]
	at := time.Now().UTC()
	_, del, err := ceshare.Encode(ceshare.Request{Kind: ceshare.KindDelete, ID: victim, Replica: "evil", At: at})
	if err != nil {
		t.Fatal(err)
	}
	_, reg, err := ceshare.Encode(ceshare.Request{Kind: ceshare.KindRegister, ID: "evil-1", Replica: "evil", At: at, CE: []byte(`{"id":"evil-1"}`)})
	if err != nil {
		t.Fatal(err)
	}
	ceOffsets := map[string]int64{
		victim:   daemontest.RawProduce(t, b, "cfguard.ce", ceshare.Partition(victim, 12), victim, del),
		"evil-1": daemontest.RawProduce(t, b, "cfguard.ce", ceshare.Partition("evil-1", 12), "evil-1", reg),
	}
	// A copy: a value the cluster signed (a deletion of the victim), written under another key, in
	// that key's partition. Its authenticator verifies, but not for where it was written.
	copyAt := daemontest.RawProduce(t, b, "cfguard.ce", ceshare.Partition("copy-1", 12), "copy-1", del,
		kafka.Header{Key: clusterkey.Header, Value: ceshare.Sign(r1.D.Replica().Keys(), del)})

	produced = daemontest.ProduceRows(t, reps[0], data, produced, 64)
	after := agree()
	if after.Version <= before.Version {
		t.Errorf("the posterior did not move past version %d after the forgeries", before.Version)
	}
	waitfor.Cond(t, 30*time.Second, "the CE topic's forgeries counted by their owners", func() bool {
		n := 0.0
		for _, r := range reps {
			n += r.Metric(t, "cfguard_replication_unauthenticated_total", "topic", "cfguard.ce")
		}
		return n >= 3
	})
	// The copy is counted by its partition's owner, with the forgeries of the partitions it owns.
	copyP := ceshare.Partition("copy-1", 12)
	waitfor.Cond(t, 30*time.Second, "the copy counted by the owner of its partition", func() bool {
		for _, r := range reps {
			owned := r.D.Share().Member().Owned()
			if !slices.Contains(owned, copyP) {
				continue
			}
			want := 0.0
			for _, p := range []int{ceshare.Partition(victim, 12), ceshare.Partition("evil-1", 12), copyP} {
				if slices.Contains(owned, p) {
					want++
				}
			}
			return r.Metric(t, "cfguard_replication_unauthenticated_total", "topic", "cfguard.ce") >= want
		}
		return false
	})
	for i, r := range reps {
		name := fmt.Sprintf("r%d", i+1)
		v := r.Model(t)
		if v.Replication.Writer == "evil/deadbeef" || v.Replication.Term != after.Replication.Term {
			t.Errorf("%s: writer %s term %d", name, v.Replication.Writer, v.Replication.Term)
		}
		if n := r.Metric(t, "cfguard_replication_unauthenticated_total", "topic", topic); n != float64(len(postOffsets)) {
			t.Errorf("%s: %v unauthenticated posterior records counted, want %d", name, n, len(postOffsets))
		}
		if n := r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "unauthenticated"); n != float64(len(postOffsets)) {
			t.Errorf("%s: %v records ignored as unauthenticated, want %d", name, n, len(postOffsets))
		}
		for _, off := range postOffsets {
			if !warnedAt(r.Logs.String(), "unauthenticated posterior log record ignored", off) {
				t.Errorf("%s: no WARN line naming the forged record at offset %d", name, off)
			}
		}
		if n := r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "coverage_past_end"); n != 1 {
			t.Errorf("%s: %v entries refused for coverage past the end, want 1", name, n)
		}
		if !warnedAt(r.Logs.String(), "posterior log entry refused: it covers input records that do not exist", pastEnd) {
			t.Errorf("%s: no WARN line naming the entry covering past the end at offset %d", name, pastEnd)
		}
		if n := r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "invalid"); n != 1 {
			t.Errorf("%s: %v signed entries refused as invalid, want 1", name, n)
		}
		if !warnedAt(r.Logs.String(), "posterior log entry refused: it authenticates under the cluster key and names the head, but does not follow from it", invalid) {
			t.Errorf("%s: no WARN line naming the invalid entry at offset %d", name, invalid)
		}
		if n := r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "other_log"); n != 1 {
			t.Errorf("%s: %v signed entries of another log refused, want 1", name, n)
		}
		if !warnedAt(r.Logs.String(), "posterior log entry refused: it authenticates under the cluster key but belongs to another log", otherLog, "genesis="+foreign.Genesis) {
			t.Errorf("%s: no WARN line naming the entry of another log at offset %d and its genesis", name, otherLog)
		}
		if code, body := r.Get(t, "/readyz"); code != http.StatusOK {
			t.Errorf("%s: /readyz %d %s", name, code, body)
		}
		if code, body := r.Get(t, "/v1/counterfactuals/"+victim); code != http.StatusOK {
			t.Errorf("%s: the CE whose deletion was forged: %d %s", name, code, body)
		}
		if code, _ := r.Get(t, "/v1/counterfactuals/evil-1"); code != http.StatusNotFound {
			t.Errorf("%s: the forged registration: %d, want 404", name, code)
		}
		for _, id := range ids {
			if code, body := r.Get(t, "/v1/counterfactuals/"+id); code != http.StatusOK {
				t.Errorf("%s: %s (registered under k1 or k2): %d %s", name, id, code, body)
			}
		}
	}
	warned := map[string]bool{}
	for _, r := range reps {
		for id, off := range ceOffsets {
			warned[id] = warned[id] || warnedAt(r.Logs.String(), "unauthenticated CE request ignored", off)
		}
	}
	for id, off := range ceOffsets {
		if !warned[id] {
			t.Errorf("no replica logged a WARN line naming the forged CE request for %s at offset %d", id, off)
		}
	}
	copied := false
	for _, r := range reps {
		copied = copied || warnedAt(r.Logs.String(), "copy of a CE request skipped", copyAt)
	}
	if !copied {
		t.Errorf("no replica logged a WARN line naming the copy at offset %d", copyAt)
	}

	// The runbook's commands for CfguardReplicationUnauthenticated, as written, at r1: the count
	// of records ignored, and the first forged record read back with kcat at the topic, partition
	// and offset its WARN line names, without an authenticator header.
	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "grep cfguard_replication_unauthenticated_total", Want: fmt.Sprintf(`(?m)^cfguard_replication_unauthenticated_total\{topic="cfguard\.posterior"\} %d$`, len(postOffsets))},
			{Cmd: "kcat -C", Want: fmt.Sprintf(`(?s)^offset %d key e/%d headers \n\{.*"kind":"increment".*"writer":%q`, postOffsets[0], forged.Seq, h.Writer)},
		}
		s := runbooktest.Named(t, filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md"), "CfguardReplicationUnauthenticated")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", r1.D.HTTPAddr(), "BROKER", b.Addrs()[0],
			"TOPIC", topic, "PARTITION", "0", "OFFSET", fmt.Sprint(postOffsets[0])), nil)

		// CfguardPosteriorLogRefused's: the counts of the signed entries refused, and the one
		// covering past the end read back with its authenticator.
		checks = []runbooktest.Check{
			{Cmd: "cfguard_posterior_log_records_ignored_total", Want: `(?m)^cfguard_posterior_log_records_ignored_total\{reason="coverage_past_end"\} 1\ncfguard_posterior_log_records_ignored_total\{reason="invalid"\} 1\ncfguard_posterior_log_records_ignored_total\{reason="other_log"\} 1$`},
			{Cmd: "kcat -C", Want: fmt.Sprintf(`(?s)^offset %d key e/%d headers cfguard-auth=.*\n\{.*"kind":"increment".*"writer":%q`, pastEnd, forged.Seq, h.Writer)},
		}
		s = runbooktest.Named(t, filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md"), "CfguardPosteriorLogRefused")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", r1.D.HTTPAddr(), "BROKER", b.Addrs()[0],
			"TOPIC", topic, "PARTITION", "0", "OFFSET", fmt.Sprint(pastEnd)), nil)
	}

	// A replica with another cluster's key does not join: no record of the log authenticates.
	wrong := daemontest.WriteKeyFile(t, "k9:"+strings.Repeat("77", 32))
	err = runReplicaOnce(t, b, "r4", t.TempDir(), wrong)
	if err == nil || !strings.Contains(err.Error(), "none authenticates") || !strings.Contains(err.Error(), "replication.key_file") {
		t.Errorf("a replica with another key: Run = %v; want a refusal naming replication.key_file", err)
	}
	// Nor does a replica that followed the log restart with another key.
	var follower *launch.Running
	for _, r := range reps {
		if !r.Model(t).Replication.Updater {
			follower = r
		}
	}
	dir := follower.Config.StateDir
	follower.Stop(t)
	err = runReplicaOnce(t, b, follower.Config.Replication.ReplicaID, dir, wrong)
	if err == nil || !strings.Contains(err.Error(), "does not authenticate") || !strings.Contains(err.Error(), "replication.key_file") {
		t.Errorf("a replica restarted with another key: Run = %v; want a refusal naming replication.key_file", err)
	}
}

// runReplicaOnce runs a replica that is expected not to start, and returns Run's error (nil
// when it started: it is stopped at once).
func runReplicaOnce(t *testing.T, b *broker.Broker, id, stateDir, keyFile string) error {
	t.Helper()
	c := config.Default()
	c.StateDir = stateDir
	c.HTTP.Listen = "127.0.0.1:0"
	c.Audit.Schedule = ""
	c.Certify.Samples = 400
	daemontest.ReplicaConfig(&c, b.Addrs(), id, keyFile)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ready := make(chan *daemon.Daemon, 1)
	done := make(chan error, 1)
	go func() {
		done <- daemon.Run(ctx, daemon.Options{Config: &c, Logger: tooltest.Logger(t),
			Registry: prometheus.NewRegistry(), Ready: ready, BundledModel: daemontest.BundledModelOf(t, &c)})
	}()
	select {
	case err := <-done:
		return err
	case <-ready:
		cancel()
		<-done
		return nil
	}
}

// A record that authenticates under the cluster key but is not an entry (a bug of a key holder,
// or a stolen key) is ignored, counted as malformed, and logged at WARN with its offset and why
// it does not decode.
func TestAuthenticatedRecordThatIsNoEntryIsLogged(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	plog := daemontest.KeyHolderLog(t, r)
	end, err := plog.End(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range []string{"this is not json", `{"format":1,"kind":"increment","seq":3}`} {
		if err := plog.Append(context.Background(), "e/x", []byte(v)); err != nil {
			t.Fatal(err)
		}
	}
	const warn = "posterior log record ignored: it authenticates under the cluster key but is not an entry"
	waitfor.Cond(t, 30*time.Second, "both records ignored as malformed", func() bool {
		return r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "malformed") == 2
	})
	for i, why := range []string{"invalid character", "postlog: malformed entry"} {
		if !warnedAt(r.Logs.String(), warn, end+int64(i), why) {
			t.Errorf("no WARN line %q at offset %d with %q:\n%s", warn, end+int64(i), why, r.Logs.String())
		}
	}
	if code, body := r.Get(t, "/readyz"); code != http.StatusOK {
		t.Errorf("/readyz after records that are no entries: %d %s", code, body)
	}
}

// An entry of a newer format stops the follower; another one read after it is counted as
// unknown_format (not malformed: it is an entry, of a build this one is older than) and logged at
// WARN with its offset.
func TestNewerFormatAfterTheStopIsCountedAsSuch(t *testing.T) {
	if testing.Short() {
		t.Skip("a replica: not with -short")
	}
	t.Parallel()
	b := daemontest.StartCluster(t, 1)
	r := launch.Replica(t, b, "r1")
	plog := daemontest.KeyHolderLog(t, r)
	newer := daemontest.ClaimOn(r.D.Replica().Head(), "r9/newer")
	newer.Format = postlog.Format + 1
	daemontest.AppendEntry(t, plog, newer)
	waitfor.Cond(t, 60*time.Second, "the replica stopped at the entry of a newer format", func() bool {
		code, body := r.Get(t, "/readyz")
		return code == http.StatusServiceUnavailable && strings.Contains(string(body), "upgrade cfguard")
	})
	end, err := plog.End(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	newer.Seq++
	daemontest.AppendEntry(t, plog, newer)
	waitfor.Cond(t, 30*time.Second, "the second entry of a newer format counted", func() bool {
		return r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "unknown_format") == 1
	})
	if n := r.Metric(t, "cfguard_posterior_log_records_ignored_total", "reason", "malformed"); n != 0 {
		t.Errorf("%v records counted as malformed, want 0", n)
	}
	const warn = "posterior log entry of a format this build does not read ignored: the replica stopped at an earlier one"
	if !warnedAt(r.Logs.String(), warn, end) {
		t.Errorf("no WARN line %q at offset %d:\n%s", warn, end, r.Logs.String())
	}
}
