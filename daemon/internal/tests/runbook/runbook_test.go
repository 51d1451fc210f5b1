package runbook

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/runbooktest"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
)

// TestRunbookCommandsRun runs every command of docs/RUNBOOK.md's single-node sections as written
// (the API's and the broker's address, the state directory and a CE's id for ID substituted)
// with bash against live daemons, and checks that each exits 0 (pipefail) and prints what
// daemontest.RunbookChecks says its section says it shows. The daemons are in the state of the
// alerts: CEs at_risk, CEs invalidated after a drift that breached the KL budget and
// dead-lettered records (CfguardKLOverBudget, CfguardCounterfactualsInvalidated,
// CfguardDeadLetterRateHigh), a change the quality detector found (CfguardModelQualityDegraded),
// a recreated input topic (CfguardTopicReset), a deleted events topic (CfguardOutboxBacklog; the
// test then creates it and the backlog drains), a daemon whose updates fail
// (CfguardUpdatesFailing), an address where nothing listens (CfguardDown). The sections whose
// state takes a daemon of its own are run by other tests: CfguardCheckpointFailing's and
// CfguardIngestStalled's in the child process of TestCheckpointFailureHoldsTheIncrement (package
// writefail), whose ledger cannot be written while records wait in the topic
// (daemontest.RunbookInChild); CfguardRenewalBehind's and CfguardRecordsLost's by
// TestRunbookOfRenewalsBehindAndRecordsLost (daemontest.RunbookOwnState); the replicas' by the
// tests RunbookReplicaSections names. curl, kcat, jq and df run for real; the test skips when
// one is missing unless CFGUARD_REQUIRE_TOOLS=1.
func TestRunbookCommandsRun(t *testing.T) {
	t.Parallel() // mostly waits for its daemons to reach their states and for the commands
	runbooktest.Tools(t, false)
	sections := runbooktest.Sections(t, daemontest.RunbookPath(t))
	// Every command is known before the daemon starts.
	var run []runbooktest.Section
	for _, s := range sections {
		if len(s.Commands) == 0 {
			continue
		}
		if by, ok := daemontest.RunbookReplicaSections[s.Name]; ok {
			t.Logf("%s: %d commands run by %s", s.Name, len(s.Commands), by)
			continue
		}
		checks, ok := daemontest.RunbookChecks[s.Name]
		if !ok {
			t.Errorf("docs/RUNBOOK.md section %s has commands and no checks in daemontest.RunbookChecks", s.Name)
			continue
		}
		runbooktest.Covered(t, s, checks)
		switch {
		case daemontest.RunbookInChild[s.Name]:
			t.Logf("%s: run by TestCheckpointFailureChild (package writefail), in the alert's state", s.Name)
		case daemontest.RunbookOwnState[s.Name]:
			t.Logf("%s: run by TestRunbookOfRenewalsBehindAndRecordsLost, in the alert's state", s.Name)
		default:
			run = append(run, s)
		}
	}
	if t.Failed() {
		t.FailNow()
	}

	// Three states: CEs at_risk; CEs invalidated (the state of every other section but one);
	// a model that learns so slowly that mislabelled records keep scoring badly after clean
	// ones, so that the change detector fires.
	atRisk := driftedDaemon(t, 1e-3, 0, 128, certify.AtRisk)
	invalidated := driftedDaemon(t, 1e-3, 64, 160, certify.Invalidated)
	quality := driftedDaemon(t, 1e-6, 256, 256, 0)
	reset := resetDaemon(t)
	backlog := outboxDaemon(t)
	failing := failingDaemon(t)
	down := downState(t)
	for _, s := range run {
		st := invalidated
		switch s.Name {
		case "CfguardCounterfactualsAtRisk":
			st = atRisk
		case "CfguardModelQualityDegraded":
			st = quality
		case "CfguardTopicReset":
			st = reset
		case "CfguardOutboxBacklog":
			st = backlog
		case "CfguardUpdatesFailing":
			st = failing
		case "CfguardDown":
			st = down
		}
		st.Run(t, s)
	}
	// The remedy of CfguardOutboxBacklog: with the events topic back, the backlog drains.
	createTopic(t, backlog.R.D.BrokerAddrs(), backlog.R.Config.Kafka.EventsTopic)
	waitfor.Cond(t, 60*time.Second, "the outbox to drain once the events topic exists again", func() bool {
		return backlog.R.Metric(t, "cfguard_events_pending") == 0
	})
	// The runbook's DELETE removed the invalidated CE the re-issue was for.
	if _, err := invalidated.R.D.Ledger().Get(invalidated.ID); err == nil {
		t.Errorf("%s is still stored after the runbook's DELETE", invalidated.ID)
	}
}

// state is a runbook state of a daemon these tests start.
type state = daemontest.RunbookState[*daemon.Daemon]

// driftedDaemon starts a daemon whose learner's steps the learning rate lr caps (daemontest.PaperLearner),
// registers 8 CEs, and produces cleans records with the data's labels, then flips records of
// benign rows labelled malignant (an update breaches the KL budget, the certificates lapse and
// are judged; after clean records, the change detector fires), and 4 malformed records
// (dead-lettered, two of them for one reason). It waits until every CE has its verdict and every
// event is published, and requires every CE to be judged want (unless want is 0).
func driftedDaemon(t *testing.T, lr float64, cleans, flips int, want certify.Status) *state {
	t.Helper()
	r := launch.Daemon(t, daemontest.WithSharedVAE(t, func(c *config.Config) {
		daemontest.PaperLearner(c, lr)
		// The runbook's re-issue (POST /v1/explain) is checked for the search's verdict (201 or
		// 422), which on a core shared with 20 busy processes takes more than the default minute.
		c.Explain.Timeout = 10 * time.Minute
	}))
	data := daemontest.Bundled(t)
	daemontest.RegisterCEs(t, r, data, 8, "")
	bad := [][]byte{[]byte("not json"), daemontest.Record("short", []float64{1, 2}, 0), daemontest.Record("alien", data.X[0], "alien"), []byte("{")}
	var clean [][]byte
	for i := range cleans {
		clean = append(clean, daemontest.Record(fmt.Sprintf("clean%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, append(append(clean, daemontest.Flipped(data, flips)...), bad...)...)
	waitfor.Cond(t, 60*time.Second, "the drift applied and the bad records dead-lettered", func() bool {
		return r.Metric(t, "cfguard_records_total", "result", "applied") == float64(len(clean)+flips) &&
			r.Metric(t, "cfguard_records_total", "result", "dead_lettered") == float64(len(bad))
	})
	waitfor.Cond(t, 60*time.Second, "every lapsed certificate judged, every event published", func() bool {
		return r.Metric(t, "cfguard_counterfactuals_renewal_pending") == 0 && r.Metric(t, "cfguard_counterfactuals_unconfirmed") == 0 &&
			r.Metric(t, "cfguard_events_pending") == 0
	})
	counts, err := r.D.Ledger().Counts()
	if err != nil {
		t.Fatal(err)
	}
	if want != 0 && counts[want] != 8 {
		t.Fatalf("%d flipped records left the CEs %v, want all 8 %v", flips, counts, want)
	}
	page, err := r.D.Ledger().List(want, 1, "")
	if err != nil || len(page) == 0 {
		t.Fatalf("no %v CE listed: %v", want, err)
	}
	return &state{R: r, ID: page[0].ID, Subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.Config.StateDir),
		"/ID", "/"+page[0].ID,
	)}
}

// failingDaemon serves a model whose every update fails (overflowingModel), and has failed one
// update of 32 records (CfguardUpdatesFailing), its update_failed event published.
func failingDaemon(t *testing.T) *state {
	t.Helper()
	data := daemontest.Bundled(t)
	r := launch.Daemon(t, func(c *config.Config) { c.Model.Path = daemontest.OverflowingModel(t) })
	var vals [][]byte
	for i := 0; i < 32; i++ {
		vals = append(vals, daemontest.Record(fmt.Sprintf("r%d", i), data.X[i], data.Y[i]))
	}
	r.Produce(t, vals...)
	waitfor.Cond(t, 30*time.Second, "one failed update of 32 records, its event published", func() bool {
		return r.Metric(t, "cfguard_updates_total", "outcome", "failed") == 1 && r.Metric(t, "cfguard_events_pending") == 0
	})
	return &state{R: r, Subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
	)}
}

// downState points the runbook at an address where no daemon listens (CfguardDown): a loopback
// port bound and never listened on, held until the test ends, so that a connection to it is
// refused and no other process can take it meanwhile.
func downState(t *testing.T) *state {
	t.Helper()
	return &state{Subst: strings.NewReplacer("127.0.0.1:8080", testnet.Reserve(t).Addr())}
}

// resetDaemon is a daemon whose input topic was deleted and recreated after it applied 64
// records, and that holds 96 new ones: ingest stopped (CfguardTopicReset).
func resetDaemon(t *testing.T) *state {
	t.Helper()
	r := launch.Daemon(t, nil)
	data := daemontest.Bundled(t)
	records := func(prefix string, n int) [][]byte { return daemontest.RowRecords(data, prefix, n) }
	r.Produce(t, records("old", 64)...)
	waitfor.Cond(t, 30*time.Second, "64 applied records", func() bool { return r.Metric(t, "cfguard_records_total", "result", "applied") == 64 })
	kafkatest.RecreateTopic(t, r.D.BrokerAddrs(), r.Config.Kafka.Topic, 1)
	r.Produce(t, records("new", 96)...)
	r.WaitResetReported(t, "ingest stopped for the reset")
	// The 96 records of the new log wait, although the ledger's offset (64) is below its end:
	// CfguardIngestStalled can fire beside CfguardTopicReset.
	waitfor.Cond(t, 30*time.Second, "cfguard_consumer_lag_records to count the new log's 96 records", func() bool {
		return r.Metric(t, "cfguard_consumer_lag_records") == 96
	})
	return &state{R: r, Subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
		"STATE_DIR", ledger.ShellQuote(r.Config.StateDir),
	)}
}

// outboxDaemon is a daemon whose events topic was deleted before a drift changed the status of
// its CEs: status changes wait in the outbox and every publish attempt fails
// (CfguardOutboxBacklog).
func outboxDaemon(t *testing.T) *state {
	t.Helper()
	r := launch.Daemon(t, func(c *config.Config) { daemontest.PaperLearner(c, 1e-3) })
	data := daemontest.Bundled(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(r.D.BrokerAddrs()...)}
	topic := r.Config.Kafka.EventsTopic
	if res, err := cl.DeleteTopics(ctx, &kafka.DeleteTopicsRequest{Topics: []string{topic}}); err != nil || res.Errors[topic] != nil {
		t.Fatalf("deleting %s: %v %v", topic, err, res)
	}
	daemontest.RegisterCEs(t, r, data, 4, "")
	r.Produce(t, daemontest.Flipped(data, 96)...)
	waitfor.Cond(t, 60*time.Second, "events waiting in the outbox after failed publish attempts", func() bool {
		return r.Metric(t, "cfguard_events_pending") > 0 && r.Metric(t, "cfguard_events_total", "result", "failed") > 0
	})
	return &state{R: r, Subst: strings.NewReplacer(
		"127.0.0.1:8080", r.D.HTTPAddr(),
		"127.0.0.1:9092", r.D.BrokerAddrs()[0],
	)}
}

// createTopic creates topic with one partition.
func createTopic(t *testing.T, brokers []string, topic string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(brokers...)}
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1, ReplicationFactor: 1}}})
	if err != nil || res.Errors[topic] != nil {
		t.Fatalf("creating %s: %v %v", topic, err, res)
	}
}
