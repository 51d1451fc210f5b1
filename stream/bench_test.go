package stream

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
)

const benchRecords = 20_000

// benchSetup starts a broker and pre-produces benchRecords records of 30 features (the size
// of the breast_cancer data set), half in array form and half in map form.
func benchSetup(b *testing.B) (*broker.Broker, *Schema) {
	b.Helper()
	const d = 30
	features := make([]string, d)
	for j := range features {
		features[j] = fmt.Sprintf("f%02d", j)
	}
	schema, err := NewSchema(features, []string{"benign", "malignant"}, 0)
	if err != nil {
		b.Fatal(err)
	}
	br := startBroker(b, broker.Config{Topics: []string{recordsTopic, deadTopic}})
	rng := rand.New(rand.NewPCG(1, 2))
	values := make([]string, benchRecords)
	for i := range values {
		var sb strings.Builder
		fmt.Fprintf(&sb, `{"id":"rec-%d","ts":%d,"label":%d,"features":`, i, 1700000000+i, i%2)
		if i%2 == 0 {
			sb.WriteByte('[')
			for j := range d {
				if j > 0 {
					sb.WriteByte(',')
				}
				fmt.Fprintf(&sb, "%.6g", rng.NormFloat64()*100)
			}
			sb.WriteByte(']')
		} else {
			sb.WriteByte('{')
			for j := range d {
				if j > 0 {
					sb.WriteByte(',')
				}
				fmt.Fprintf(&sb, "%q:%.6g", features[j], rng.NormFloat64()*100)
			}
			sb.WriteByte('}')
		}
		sb.WriteByte('}')
		values[i] = sb.String()
	}
	produce(b, plainConn(br), recordsTopic, 0, values...)
	return br, schema
}

// BenchmarkIngest measures sustained ingest (fetch, decode, validate, batch into increments;
// no model update) against a plain kafka-go consumer-group read of the same messages from the
// same broker with the same reader settings, in the same run. Each iteration reads all
// benchRecords messages with a fresh group; the clock runs from the first message to the last
// (group join excluded). The cfguard sub-benchmark reports ratio = plain ns/record divided by
// cfguard ns/record (throughput relative to plain kafka-go; goal >= 0.5), and cpu-ratio, the
// same with the process's CPU time (broker and kafka-go included) instead of wall time: on a
// machine whose cores are busy with other work, wall time swings with the load while CPU
// time per record stays put. Run both sub-benchmarks in one invocation:
//
//	go test -run '^$' -bench Ingest -benchtime 10x ./stream/
func BenchmarkIngest(b *testing.B) {
	br, schema := benchSetup(b)
	conn := plainConn(br)
	var plainNs, plainCPU float64
	group := 0
	cfgFor := func() ConsumerConfig {
		group++
		cfg := consumerConfig(conn, fmt.Sprintf("bench-%d", group))
		cfg.MaxRecords = 1000
		cfg.MaxWait = 2 * time.Second
		if err := cfg.applyDefaults(); err != nil {
			b.Fatal(err)
		}
		return cfg
	}
	ctx := context.Background()

	b.Run("kafka-go", func(b *testing.B) {
		var total, cpu time.Duration
		for range b.N {
			cfg := cfgFor()
			r := kafka.NewReader(readerConfig(&cfg, testLog(b)))
			if _, err := r.FetchMessage(ctx); err != nil {
				b.Fatal(err)
			}
			t0, c0 := time.Now(), cpuTime()
			for n := 1; n < benchRecords; n++ {
				if _, err := r.FetchMessage(ctx); err != nil {
					b.Fatal(err)
				}
			}
			total += time.Since(t0)
			cpu += cpuTime() - c0
			r.Close()
		}
		plainNs = float64(total.Nanoseconds()) / float64(b.N*(benchRecords-1))
		b.ReportMetric(plainNs, "ns/record")
		plainCPU = float64(cpu.Nanoseconds()) / float64(b.N*(benchRecords-1))
		b.ReportMetric(plainCPU, "cpu-ns/record")
	})

	b.Run("cfguard", func(b *testing.B) {
		var total, cpu time.Duration
		timed := 0
		for range b.N {
			c, err := NewConsumer(ctx, cfgFor(), schema, testLog(b))
			if err != nil {
				b.Fatal(err)
			}
			// The first increment includes the group join; time the rest.
			inc, err := c.Next(ctx)
			if err != nil {
				b.Fatal(err)
			}
			got := len(inc.Records)
			timed += benchRecords - got
			t0, c0 := time.Now(), cpuTime()
			for got < benchRecords {
				inc, err := c.Next(ctx)
				if err != nil {
					b.Fatal(err)
				}
				got += len(inc.Records)
			}
			total += time.Since(t0)
			cpu += cpuTime() - c0
			if got != benchRecords || c.Stats().Decoded != benchRecords {
				b.Fatalf("decoded %d records, want %d", got, benchRecords)
			}
			c.Close()
		}
		ns := float64(total.Nanoseconds()) / float64(timed)
		b.ReportMetric(ns, "ns/record")
		cpuNs := float64(cpu.Nanoseconds()) / float64(timed)
		b.ReportMetric(cpuNs, "cpu-ns/record")
		if plainNs > 0 {
			b.ReportMetric(plainNs/ns, "ratio")
			b.ReportMetric(plainCPU/cpuNs, "cpu-ratio")
		}
	})
}

// BenchmarkDecode is the decoder alone, per record of 30 features, in both forms.
func BenchmarkDecode(b *testing.B) {
	features := strings.Split("a b c d e f g h i j k l m n o p q r s t u v w x y z A B C D", " ")
	s, err := NewSchema(features, []string{"x", "y"}, 0)
	if err != nil {
		b.Fatal(err)
	}
	for _, form := range []string{"array", "map"} {
		var sb strings.Builder
		sb.WriteString(`{"id":"rec-123","ts":1700000123,"label":1,"features":`)
		sb.WriteString(map[string]string{"array": "[", "map": "{"}[form])
		for j := range 30 {
			if j > 0 {
				sb.WriteByte(',')
			}
			if form == "map" {
				fmt.Fprintf(&sb, "%q:", features[j])
			}
			fmt.Fprintf(&sb, "%.6g", float64(j)*1.2345-17)
		}
		sb.WriteString(map[string]string{"array": "]}", "map": "}}"}[form])
		rec := []byte(sb.String())
		b.Run(form, func(b *testing.B) {
			b.SetBytes(int64(len(rec)))
			for b.Loop() {
				if _, err := s.Decode(rec); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// cpuTime is the CPU time (user + system) used by this process so far: the broker, kafka-go
// and our code all run in it.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
