package replicalog

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/daemon"
	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/daemon/internal/daemontest/launch"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/postlog"
)

// longLog starts a replica whose posterior log has n increments of one record each, and
// returns it with its current version. With refused, an increment every replica refuses (signed,
// on the head after the tenth record, covering offsets past the input's end) lies among them.
func longLog(t testing.TB, n int, refused bool) (*launch.Running, uint64) {
	t.Helper()
	b := daemontest.StartCluster(t, 1)
	keys := daemontest.WriteKeyFile(t, daemontest.ClusterKey)
	r := launch.With(t, func(c *config.Config) {
		daemontest.ReplicaConfig(c, b.Addrs(), "r1", keys)
		c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 1, 1 // an entry per record
	}, nil, nil)
	waitfor.Cond(t, 60*time.Second, "r1 ready", func() bool { code, _ := r.Get(t, "/readyz"); return code == 200 })
	applied := func(n int) {
		waitfor.Cond(t, 2*time.Minute, fmt.Sprintf("%d records applied", n), func() bool {
			return daemontest.GatherCounter(r.Reg, "cfguard_records_total", "result", "applied") == float64(n)
		})
	}
	from := 0
	if refused {
		from = daemontest.ProduceRows(t, r, daemontest.Bundled(t), 0, 10)
		applied(from)
		waitfor.Cond(t, time.Minute, "the log covers the 10 records", func() bool { return r.D.Replica().Head().Covers[0] == int64(from) })
		h := r.D.Replica().Head()
		m := r.D.Posterior().Clone()
		m.Last().WeightMu[0] += 0.5
		m.Version = h.Version + 1
		sha, err := postlog.PosteriorHash(m)
		if err != nil {
			t.Fatal(err)
		}
		daemontest.AppendEntry(t, daemontest.KeyHolderLog(t, r), &postlog.Entry{Format: postlog.Format, Kind: postlog.Increment, Seq: h.Seq + 1,
			Parent: h.Hash, Term: h.Term, Writer: h.Writer, Version: m.Version, ParentVersion: h.Version, Covers: map[int]int64{0: 1 << 40},
			Outcome: postlog.Promoted, Counts: &postlog.Counts{Applied: 1}, LastLayer: postlog.LastLayerOf(m), PosteriorSHA256: sha})
		waitfor.Cond(t, time.Minute, "the entry past the input's end refused", func() bool {
			return daemontest.GatherCounter(r.Reg, "cfguard_posterior_log_records_ignored_total", "reason", "coverage_past_end") == 1
		})
	}
	daemontest.ProduceRows(t, r, daemontest.Bundled(t), from, n-from)
	applied(n)
	return r, r.D.Posterior().Version
}

// TestPastFindsOldPosteriors asks a replica for posteriors older than those it keeps in memory,
// in the orders a rebuild does (ascending batches) and does not (a version below the last
// batch's): each answer holds every version asked for that the log has, and only those. The log
// holds an increment every replica refused (its coverage passes the input's end): a replay
// refuses it too, or it would take that entry's posterior and find no version after it.
func TestPastFindsOldPosteriors(t *testing.T) {
	t.Parallel()
	r, cur := longLog(t, 300, true)
	if cur < 290 {
		t.Fatalf("version %d after 300 one-record increments (promoted %v, clipped %v, rejected %v, failed %v)", cur,
			daemontest.GatherCounter(r.Reg, "cfguard_updates_total", "outcome", "promoted"), daemontest.GatherCounter(r.Reg, "cfguard_updates_total", "outcome", "clipped"),
			daemontest.GatherCounter(r.Reg, "cfguard_updates_total", "outcome", "rejected"), daemontest.GatherCounter(r.Reg, "cfguard_updates_total", "outcome", "failed"))
	}
	for _, want := range [][]uint64{
		{3, 1, 2},
		{10, 40},
		{41},
		{5, 41, 42},   // below the last replay's newest: read again from the start
		{cur - 1, 0},  // a recent one and the genesis
		{43, cur + 5}, // one the log does not have (yet)
		{cur + 6},
		{cur - 300, 44},   // from the place 43 was found at
		{cur - 299, 2, 3}, // 2 and 3 found before, cur-299 from cur-300's place
		{cur - 300},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		got, err := r.D.Replica().Past(ctx, want)
		cancel()
		if err != nil {
			t.Fatalf("Past(%v): %v", want, err)
		}
		var found []uint64
		for v, m := range got {
			if m.Version != v {
				t.Errorf("Past(%v): version %d holds the posterior of version %d", want, v, m.Version)
			}
			found = append(found, v)
		}
		var inLog []uint64
		for _, v := range want {
			if v <= cur {
				inLog = append(inLog, v)
			}
		}
		slices.Sort(found)
		slices.Sort(inLog)
		if !slices.Equal(found, inLog) {
			t.Errorf("Past(%v) found %v, want %v", want, found, inLog)
		}
	}
}

// BenchmarkPastOfARebuild measures what a rebuild asks of the posterior log (cluster.Share.applyOps:
// one call of Replica.Past per batch) at a replica whose log has 600 one-record increments: the
// posteriors of anchors older than the 256 it keeps, in 20 batches of 10 ascending versions, as
// a partition's registrations come in the order they were measured, and, with verdicts, the
// versions restored verdicts were measured under: two per batch of eight spread over the log (a
// confirmer measures a batch of CEs under one version), none before the batch's anchors. ns/op
// is one rebuild's. Each sub-benchmark starts its own replica, but its later iterations start
// from the places its earlier ones kept: run it with -benchtime 1x for a replica's first.
func BenchmarkPastOfARebuild(b *testing.B) {
	const batches, per = 20, 10
	rebuild := func(b *testing.B, verdicts bool) {
		r, cur := longLog(b, 600, false)
		old := cur - 300 // versions 1..old are not in memory
		var asks [][]uint64
		for i := range batches {
			var vs []uint64
			for k := range per {
				vs = append(vs, 1+uint64(i*per+k)*(old-1)/(batches*per))
			}
			if verdicts {
				for _, k := range []uint64{uint64(i) % 8, uint64(i+3) % 8} {
					vs = append(vs, max(vs[per-1], 1+k*(old-1)/8))
				}
			}
			asks = append(asks, vs)
		}
		ctx := context.Background()
		for b.Loop() {
			for _, vs := range asks {
				got, err := r.D.Replica().Past(ctx, vs)
				if err != nil || len(got) != len(slices.Compact(slices.Sorted(slices.Values(vs)))) {
					b.Fatalf("Past(%v): %d found, %v", vs, len(got), err)
				}
			}
		}
	}
	b.Run("anchors", func(b *testing.B) { rebuild(b, false) })
	b.Run("anchors_and_verdicts", func(b *testing.B) { rebuild(b, true) })
}

// recallEntries is how many one-record increments the posterior log of BenchmarkRecall holds:
// enough that the play's cost per record outweighs a reader's opening and closing, few enough
// that a run of -count 10 takes about two minutes.
const recallEntries = 3000

// BenchmarkRecall measures Replica.Recall at a replica restarted from its ledger, whose posterior
// log has recallEntries one-record increments: the play of the log from its first record that
// finds the 255 versions before the current one. An op of recall is one Recall; before it, with
// the timer stopped, the replica is started again on its state directory (its own recall held,
// so that only the benchmark's plays the log) and the log is read plainly (plain_read's op), so
// that recall/plain, the ratio of the two, is measured under the same load. plain_read is the
// floor: a kafka-go reader of the same records, from the first to the head, that decodes nothing
// and is closed, as the play's is. ns/entry is an op's time over the number of records in the log.
func BenchmarkRecall(b *testing.B) {
	r, _ := longLog(b, recallEntries, false)
	cfg, records := *r.Config, r.D.Replica().Head().Offset+1
	r.Stop(b)
	ctx := context.Background()
	plainRead := func(b *testing.B) time.Duration {
		start := time.Now()
		rd := kafka.NewReader(kafka.ReaderConfig{Brokers: cfg.Kafka.Brokers, Topic: cfg.Replication.PosteriorTopic, Partition: 0,
			MinBytes: 1, MaxBytes: postlog.MaxRecordBytes + 64<<10, MaxWait: postlog.ReaderMaxWait})
		for {
			m, err := rd.FetchMessage(ctx)
			if err != nil {
				b.Fatal(err)
			}
			if m.Offset == records-1 {
				break
			}
		}
		if err := rd.Close(); err != nil { // as Recall's play closes its reader
			b.Fatal(err)
		}
		return time.Since(start)
	}
	perEntry := func(b *testing.B, took time.Duration, ops int) {
		b.ReportMetric(float64(took.Nanoseconds())/float64(int64(ops)*records), "ns/entry")
	}
	b.Run("recall", func(b *testing.B) {
		var recall, plain time.Duration
		ops := 0
		for b.Loop() {
			b.StopTimer()
			rr := launch.With(b, func(c *config.Config) {
				daemontest.ReplicaConfig(c, cfg.Kafka.Brokers, cfg.Replication.ReplicaID, cfg.Replication.KeyFile)
				c.StateDir = cfg.StateDir
				c.Kafka.MaxRecords, c.Kafka.MaxRecordsBacklog = 1, 1
			}, func(o *daemon.Options) {
				o.Hooks.Recall = func(ctx context.Context) { <-ctx.Done() }
			}, nil)
			waitfor.Cond(b, 60*time.Second, "the restarted replica ready", func() bool { code, _ := rr.Get(b, "/readyz"); return code == 200 })
			plain += plainRead(b)
			b.StartTimer()
			start := time.Now()
			got, err := rr.D.Replica().Recall(ctx)
			recall += time.Since(start)
			b.StopTimer()
			if err != nil || len(got) != 255 {
				b.Fatalf("Recall: %d versions, %v; want 255", len(got), err)
			}
			rr.Stop(b)
			ops++
			b.StartTimer()
		}
		b.ReportMetric(float64(recall)/float64(plain), "recall/plain")
		perEntry(b, recall, ops)
	})
	b.Run("plain_read", func(b *testing.B) {
		var took time.Duration
		ops := 0
		for b.Loop() {
			took += plainRead(b)
			ops++
		}
		perEntry(b, took, ops)
	})
}
