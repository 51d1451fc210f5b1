package replicalog

import (
	"log/slog"
	"math/rand/v2"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/replica"
	"github.com/cfguard/cfguard/stream"
)

// refusedWith waits until r's /readyz answers 503 and returns its body.
func refusedWith(t *testing.T, r *launch.Running) string {
	t.Helper()
	var body string
	waitfor.Cond(t, 60*time.Second, "/readyz refusing", func() bool {
		code, b := r.Get(t, "/readyz")
		body = string(b)
		return code == http.StatusServiceUnavailable && strings.Contains(body, "not joining the cluster")
	})
	return body
}

// TestReplicaSettingsMustMatchTheGenesis: the genesis records the cluster-wide settings of the
// replica that wrote it. A replica whose file has another certify.delta, or another data set
// and certify.mode: tight, does not join: its /readyz, its log and
// cfguard_replication_settings_differ name every differing key with both values and the
// genesis's offset, it owns no CE partition and writes nothing to the log. A replica that
// differs only in local keys joins, and a member restarted with an edited file refuses too. The
// web UI of a refused replica gives the refusal and serves the runbook.
func TestReplicaSettingsMustMatchTheGenesis(t *testing.T) {
	if testing.Short() {
		t.Skip("several daemons: not with -short")
	}
	t.Parallel() // replicas mostly wait for their group and for each other
	b := daemontest.StartCluster(t, 1)
	key := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r1 := launch.ReplicaKey(t, b, "r1", key)

	delta := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r-delta", key)
		c.Certify.Delta = 0.2
	}, nil, nil)
	body := refusedWith(t, delta)
	want := "certify.delta: this replica 0.2, the cluster's log 0.05 (genesis at offset 0 of cfguard.posterior); align the file"
	if !strings.Contains(body, want) {
		t.Fatalf("/readyz: %s\nwant it to hold %q", body, want)
	}
	if strings.Count(body, ": this replica ") != 1 {
		t.Fatalf("/readyz names keys that do not differ: %s", body)
	}
	if got := testutil.ToFloat64(delta.D.Replica().Metrics().SettingsDiffer); got != 1 {
		t.Fatalf("cfguard_replication_settings_differ %v, want 1", got)
	}
	if !strings.Contains(delta.Logs.String(), "certify.delta: this replica 0.2") {
		t.Fatalf("the refusal is not in the log:\n%s", delta.Logs.String())
	}
	if code, _ := delta.Get(t, "/v1/model"); code != http.StatusServiceUnavailable {
		t.Fatalf("GET /v1/model on a replica that did not join: %d, want 503", code)
	}
	// The alert's page (ui_path /ui/) says why, as a page, and its runbook section is served.
	if code, b := delta.Get(t, "/ui/"); code != http.StatusServiceUnavailable || !strings.Contains(string(b), "refused to join its cluster") ||
		!strings.Contains(string(b), "certify.delta: this replica 0.2") || !strings.Contains(string(b), `href="/ui/runbook#cfguardreplicasettingsdiffer"`) {
		t.Fatalf("GET /ui/ on a replica that did not join: %d\n%s\nwant a page giving the refusal and linking the runbook", code, b)
	}
	if code, b := delta.Get(t, "/ui/runbook"); code != http.StatusOK || !strings.Contains(string(b), `id="cfguardreplicasettingsdiffer"`) {
		t.Fatalf("GET /ui/runbook on a replica that did not join: %d", code)
	}
	// The runbook's commands for CfguardReplicaSettingsDiffer, as written, at that replica.
	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "/readyz", Want: `certify\.delta: this replica 0\.2, the cluster's log 0\.05 \(genesis at offset 0 of cfguard\.posterior\)`},
			{Cmd: "settings_differ", Want: `(?m)^cfguard_replication_settings_differ 1$`},
		}
		s := runbooktest.Named(t, filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md"), "CfguardReplicaSettingsDiffer")
		runbooktest.Covered(t, s, checks)
		runbooktest.Run(t, s, checks, strings.NewReplacer("127.0.0.1:8080", delta.D.HTTPAddr()), nil)
	}

	other := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r-data", key)
		c.Model.Dataset = "german_credit"
		c.Certify.Mode = "tight"
	}, nil, nil)
	body = refusedWith(t, other)
	for _, k := range []string{"certify.mode: this replica tight, the cluster's log paper", "model.dataset: this replica german_credit, the cluster's log breast_cancer",
		"schema.classes: this replica bad,good, the cluster's log malignant,benign", "schema.features: "} {
		if !strings.Contains(body, k) {
			t.Errorf("/readyz does not name %q: %s", k, body)
		}
	}
	if got := testutil.ToFloat64(other.D.Replica().Metrics().SettingsDiffer); got != 4 {
		t.Errorf("cfguard_replication_settings_differ %v, want 4", got)
	}

	// Local differences only: it joins and serves the cluster's posterior.
	local := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r-local", key)
		c.HTTP.Token = "another-token"
		c.HTTP.WriteTimeout = 70 * time.Second
		c.Explain.Concurrency = 1
		c.Audit.Schedule = "@every 5h"
		c.Replication.HeartbeatInterval = 400 * time.Millisecond
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "the replica with local differences ready", func() bool { code, _ := local.Get(t, "/readyz"); return code == 200 })
	if got, want := local.D.Replica().Head().PosteriorSHA256, r1.D.Replica().Head().PosteriorSHA256; got != want {
		t.Fatalf("posterior %s, the cluster's %s", got, want)
	}
	if got := testutil.ToFloat64(local.D.Replica().Metrics().SettingsDiffer); got != 0 {
		t.Fatalf("cfguard_replication_settings_differ %v on a matching replica", got)
	}
	// The refused replicas take no part: no updater group, no CE share.
	if delta.D.Replica().Updater() || other.D.Replica().Updater() || delta.D.Share() != nil || other.D.Share() != nil {
		t.Fatal("a refused replica takes part in the cluster")
	}

	// A member restarted with an edited file refuses on its own ledger.
	dir := r1.Config.StateDir
	r1.Stop(t)
	again := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.StateDir = dir
		c.Update.Seed = 9
	}, nil, nil)
	body = refusedWith(t, again)
	if !strings.Contains(body, "update.seed: this replica 9, the cluster's log 1 (genesis at offset 0") {
		t.Fatalf("/readyz of the restarted replica: %s", body)
	}
}

// A genesis written without settings (a log begun before they were recorded) is followed with a
// WARN that the settings cannot be checked, whatever the replica's file says: refusing it would
// stop every replica of such a cluster at its upgrade.
func TestGenesisWithoutSettingsIsFollowedWithAWarning(t *testing.T) {
	_, _, _, sha, r := followGenesisWithoutSettings(t)
	if got := r.D.Replica().Head().PosteriorSHA256; got != sha {
		t.Fatalf("posterior %s, the genesis's %s", got, sha)
	}
	if !strings.Contains(r.Logs.String(), "the posterior log's genesis records no settings") {
		t.Fatalf("no warning that the settings cannot be checked:\n%s", r.Logs.String())
	}
}

// followGenesisWithoutSettings starts a cluster whose posterior log begins with a genesis that
// records no settings, as a build before they were recorded wrote it, and a replica r1 (with
// certify.delta 0.2) that follows it, ready. It returns the broker, the key file, the log (open
// until the test ends), the genesis's posterior hash and the replica.
func followGenesisWithoutSettings(t *testing.T) (b *broker.Broker, key string, plog *postlog.Log, sha string, r *launch.Running) {
	t.Helper()
	b = daemontest.StartCluster(t, 1)
	key = daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	keys, err := clusterkey.Load(key)
	if err != nil {
		t.Fatal(err)
	}
	m := bnn.New(30, []int{8}, []string{"malignant", "benign"}, 1, rand.New(rand.NewPCG(3, 4)))
	body, err := postlog.NewBody(m)
	if err != nil {
		t.Fatal(err)
	}
	if sha, err = postlog.PosteriorHash(m); err != nil {
		t.Fatal(err)
	}
	if plog, err = postlog.Open(t.Context(), stream.ConnConfig{Brokers: b.Addrs()}, "cfguard.posterior", keys, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plog.Close() })
	daemontest.AppendEntry(t, plog, &postlog.Entry{Format: postlog.Format, Kind: postlog.Genesis, Writer: "old/1", PosteriorSHA256: sha, Body: body})
	r = launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.Certify.Delta = 0.2
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "the replica ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	return b, key, plog, sha, r
}

// A running replica that meets a new epoch recording settings its file does not have (cfguard
// new-epoch records the file's settings on a log whose genesis records none) stops following
// there, serving the last posterior it applied: /readyz names each differing key and points to
// CfguardReplicaSettingsDiffer, whose gauge and commands say so, as does
// cfguard_posterior_log_stopped. Restarted with the epoch's settings, it applies the epoch.
func TestNewEpochWithOtherSettingsStopsARunningReplica(t *testing.T) {
	if testing.Short() {
		t.Skip("two daemons: not with -short")
	}
	t.Parallel() // mostly waits for the replica's group
	b, key, plog, _, r := followGenesisWithoutSettings(t)
	h := r.D.Replica().Head()
	epochCfg := *r.Config
	epochCfg.Certify.Delta = 0.05
	settings, err := replica.ClusterSettings(&epochCfg)
	if err != nil {
		t.Fatal(err)
	}
	daemontest.AppendEntry(t, plog, epochOn(t, r, h, settings))

	var body string
	waitfor.Cond(t, 60*time.Second, "the replica stopped at the epoch", func() bool {
		code, b := r.Get(t, "/readyz")
		body = string(b)
		return code == http.StatusServiceUnavailable && r.Metric(t, "cfguard_posterior_log_stopped") == 1
	})
	for _, want := range []string{"a new epoch of the posterior log records other cluster-wide settings than this replica's file: certify.delta: this replica 0.2, the cluster's log 0.05",
		"restart this replica", "CfguardReplicaSettingsDiffer"} {
		if !strings.Contains(body, want) {
			t.Fatalf("/readyz of the stopped replica: %s\nwant it to hold %q", body, want)
		}
	}
	if got := r.Metric(t, "cfguard_replication_settings_differ"); got != 1 {
		t.Fatalf("cfguard_replication_settings_differ %v, want 1", got)
	}
	if code, _ := r.Get(t, "/v1/model"); code != http.StatusOK {
		t.Fatalf("GET /v1/model on the stopped replica: %d, want 200 (it serves the last posterior it applied)", code)
	}
	if runbooktest.Tools(t, true) {
		checks := []runbooktest.Check{
			{Cmd: "/readyz", Want: `a new epoch of the posterior log records other cluster-wide settings than this replica's file: certify\.delta: this replica 0\.2, the cluster's log 0\.05`},
			{Cmd: "settings_differ", Want: `(?m)^cfguard_replication_settings_differ 1$`},
		}
		runbooktest.Run(t, runbooktest.Named(t, filepath.Join(tooltest.RepoRoot(t), "docs", "RUNBOOK.md"), "CfguardReplicaSettingsDiffer"), checks, strings.NewReplacer("127.0.0.1:8080", r.D.HTTPAddr()), nil)
	}

	dir := r.Config.StateDir
	r.Stop(t)
	again := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", key)
		c.StateDir = dir
		c.Certify.Delta = 0.05
	}, nil, nil)
	code := 0
	defer func() {
		if t.Failed() {
			t.Logf("the restarted replica: /readyz %d %s, entry %d", code, body, again.D.Replica().Head().Seq)
		}
	}()
	waitfor.Cond(t, 60*time.Second, "the restarted replica past the epoch", func() bool {
		var b []byte
		code, b = again.Get(t, "/readyz")
		body = string(b)
		return code == http.StatusOK && again.D.Replica().Head().Seq > h.Seq
	})
	if got := again.Metric(t, "cfguard_replication_settings_differ"); got != 0 {
		t.Fatalf("cfguard_replication_settings_differ %v after the restart, want 0", got)
	}
}
