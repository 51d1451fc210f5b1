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

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/config"
)

// BenchmarkIngestEndToEnd measures sustained ingest through the whole daemon (decode,
// validation, batching, last-layer update, KL, re-certification, checkpoint, commit) against
// a plain kafka-go consumer-group read of the same messages from the same broker in the same
// run. Each iteration consumes all records with a fresh group. Report the two records/s.
//
//	go test -run '^$' -bench IngestEndToEnd -benchtime 3x ./daemon
func BenchmarkIngestEndToEnd(b *testing.B) {
	const n = 20000
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	br, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"}, Partitions: 1}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer br.Close()
	set, ds, _ := assets.Load("breast_cancer")
	w := &kafka.Writer{Addr: kafka.TCP(br.Addrs()...), Topic: "cfguard.records", BatchSize: 1000, BatchBytes: 900_000}
	msgs := make([]kafka.Message, n)
	for i := range msgs {
		v, _ := json.Marshal(map[string]any{"id": fmt.Sprint(i), "features": set.X[i%set.Len()], "label": set.Y[i%set.Len()]})
		msgs[i] = kafka.Message{Value: v}
	}
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		b.Fatal(err)
	}
	w.Close()
	m, _, err := bnn.Fit(ctx, set, ds.Classes, bnn.TrainConfig{Seed: 1, Epochs: 5})
	if err != nil {
		b.Fatal(err)
	}
	modelDir := filepath.Join(b.TempDir(), "model")
	bnn.Save(modelDir, m)

	b.Run("kafka-go", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: br.Addrs(), Topic: "cfguard.records", GroupID: fmt.Sprintf("plain-%d-%d", b.N, i), MaxWait: 500 * time.Millisecond})
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
		b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "records/s")
	})
	for _, size := range []int{64, 1000} {
		b.Run(fmt.Sprintf("cfguard/max_records=%d", size), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				c := config.Default()
				c.StateDir, c.HTTP.Listen, c.Model.Path = b.TempDir(), "127.0.0.1:0", modelDir
				c.Kafka.Brokers, c.Kafka.GroupID, c.Kafka.MaxRecords, c.Kafka.MaxWait = br.Addrs(), fmt.Sprintf("cfguard-%d-%d-%d", size, b.N, i), size, time.Second
				c.Audit.Schedule = ""
				reg := prometheus.NewRegistry()
				rctx, stop := context.WithCancel(ctx)
				ready := make(chan *Daemon, 1)
				done := make(chan error, 1)
				go func() {
					done <- Run(rctx, Options{Config: &c, Logger: slog.New(slog.DiscardHandler), Registry: reg, Ready: ready})
				}()
				d := <-ready
				for {
					st, err := d.ledger.State()
					if err != nil {
						b.Fatal(err)
					}
					if st.Applied == n {
						break
					}
					time.Sleep(2 * time.Millisecond)
				}
				stop()
				if err := <-done; err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(n*b.N)/b.Elapsed().Seconds(), "records/s")
		})
	}
}
