package daemon

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/daemon/internal/daemontest"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/tooltest"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
)

// BenchmarkIngestEndToEnd measures sustained ingest through the whole daemon (fetch, decode,
// validation, increments, last-layer update, KL, re-certification, checkpoint, events, group
// commit) against a plain kafka-go consumer-group read of the same messages from the same broker
// in the same run. Each iteration consumes all records with a fresh group and state directory.
//
//	kafka-go                      records/s of FetchMessage (+ a commit per 1000)
//	cfguard/default               the default configuration (kafka.max_records 64,
//	                              kafka.max_records_backlog stream.DefaultMaxRecordsBacklog,
//	                              kafka.max_wait 5s); ratio = its records/s over kafka-go's
//	cfguard/max_records_backlog=N the same with the backlog cap N (64: increments never grow)
//
// and, for the cfguard runs, cpu/wall: the process's CPU time (getrusage; broker, kafka-go and
// the daemon all run in it) per wall-clock second of ingest. Where the rest of the wall time
// goes is for the execution tracer (-trace, then go tool trace -pprof=syscall|net|sync). Run:
//
//	go test -run '^$' -bench IngestEndToEnd -benchtime 2x ./daemon
func BenchmarkIngestEndToEnd(b *testing.B) {
	// An increment short of max_records stays open up to max_wait (5 s) for more records, by
	// design: that is latency, not throughput. Increments take what is fetched (up to the backlog
	// cap) whenever the consumer is caught up for a moment, so whatever n is, the last one can be
	// short: with a cap of 256, one run in three applied 20,448 records in 1.04 s and the last 32
	// at 5.9 s. So an iteration ends when every record but the last max_records - 1 is applied,
	// and the rate counts the records applied by then.
	const n = 20480
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	br, _, _, modelDir := benchStream(b, n)

	var plain float64 // kafka-go's records/s
	// Every read uses a group the broker has not seen: with -count > 1 a sub-benchmark runs again
	// with the same b.N, and a group that already committed the end of the topic would wait
	// for records forever.
	groups := 0
	group := func(prefix string) string {
		groups++
		return fmt.Sprintf("%s-%d", prefix, groups)
	}
	b.Run("kafka-go", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: br.Addrs(), Topic: "cfguard.records", GroupID: group("plain"), MaxWait: 500 * time.Millisecond})
			for k := 0; k < n; k++ {
				m, err := r.FetchMessage(ctx)
				if err != nil {
					b.Fatal(err)
				}
				if k%1000 == 999 || k == n-1 {
					r.CommitMessages(ctx, m)
				}
			}
			r.Close()
		}
		plain = float64(n*b.N) / b.Elapsed().Seconds()
		b.ReportMetric(plain, "records/s")
	})
	run := func(name string, backlog int) {
		b.Run(name, func(b *testing.B) {
			var cpu, wall time.Duration
			applied := 0
			for i := 0; i < b.N; i++ {
				c := config.Default()
				c.StateDir, c.HTTP.Listen, c.Model.Path = b.TempDir(), "127.0.0.1:0", modelDir
				c.Kafka.Brokers, c.Kafka.GroupID = br.Addrs(), group("cfguard-"+name)
				if backlog > 0 {
					c.Kafka.MaxRecordsBacklog = backlog
				}
				c.Audit.Schedule = ""
				reg := prometheus.NewRegistry()
				rctx, stop := context.WithCancel(ctx)
				ready := make(chan *Daemon, 1)
				done := make(chan error, 1)
				go func() {
					done <- Run(rctx, Options{Config: &c, Logger: slog.New(slog.DiscardHandler), Registry: reg, Ready: ready})
				}()
				d := <-ready
				t0, c0 := time.Now(), cpuTime()
				for {
					st, err := d.ledger.State()
					if err != nil {
						b.Fatal(err)
					}
					if st.Applied >= int64(n-(c.Kafka.MaxRecords-1)) {
						applied += int(st.Applied)
						break
					}
					time.Sleep(2 * time.Millisecond)
				}
				wall += time.Since(t0)
				cpu += cpuTime() - c0
				stop()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
			rate := float64(applied) / b.Elapsed().Seconds()
			b.ReportMetric(rate, "records/s")
			if plain > 0 {
				b.ReportMetric(rate/plain, "ratio")
			}
			b.ReportMetric(cpu.Seconds()/wall.Seconds(), "cpu/wall")
		})
	}
	run("cfguard/default", 0)
	for _, backlog := range []int{64, 256, 3200} {
		run(fmt.Sprintf("cfguard/max_records_backlog=%d", backlog), backlog)
	}
}

// cpuTime is the CPU time (user + system) this process has used.
func cpuTime() time.Duration {
	d, _ := tooltest.SelfCPU()
	return d
}

// benchStream starts a broker on loopback with the daemon's topics, produces n records of the
// bundled breast-cancer data to cfguard.records, and trains and saves the benchmarks' model. The
// broker stops when the benchmark ends.
func benchStream(b *testing.B, n int) (br *broker.Broker, set *dataset.Set, m *bnn.Model, modelDir string) {
	b.Helper()
	br = daemontest.StartCluster(b, 1)
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		b.Fatal(err)
	}
	w := &kafka.Writer{Transport: kafkatest.Transport(b), Addr: kafka.TCP(br.Addrs()...), Topic: "cfguard.records", BatchSize: 1000, BatchBytes: 900_000}
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		v, _ := json.Marshal(map[string]any{"id": fmt.Sprint(i), "features": set.X[i%set.Len()], "label": set.Y[i%set.Len()]})
		msgs[i] = kafka.Message{Value: v}
	}
	if err := w.WriteMessages(b.Context(), msgs...); err != nil {
		b.Fatal(err)
	}
	w.Close()
	m, _, err = bnn.Fit(b.Context(), set, ds.Classes, bnn.TrainConfig{Seed: 1, Epochs: 5})
	if err != nil {
		b.Fatal(err)
	}
	modelDir = filepath.Join(b.TempDir(), "model")
	if err := bnn.Save(modelDir, m); err != nil {
		b.Fatal(err)
	}
	return br, set, m, modelDir
}
