package postlog

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/clusterkey"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/stream"
)

// A posterior topic whose settings lose entries: a compacted one is refused by a writer (a
// replica's Open, cfguard new-epoch's OpenExistingWriter), with the key, the setting and the
// command that mends it, and read with a WARN line by a reader (verify-log's OpenExisting); one
// with a finite retention is opened with an ERROR line naming the setting. A topic Open creates
// keeps its records for ever, and is opened without a word.
func TestOpenChecksTheTopicsSettings(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Topics: []string{"other"}, Partitions: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	conn := stream.ConnConfig{Brokers: b.Addrs()}
	keys, err := clusterkey.Parse([]byte("k1:"+strings.Repeat("5a", 32)), "test")
	if err != nil {
		t.Fatal(err)
	}
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...), Transport: kafkatest.Transport(t)}
	for _, tc := range []struct {
		name    string
		configs []kafka.ConfigEntry // nil: Open creates the topic
		refused string              // in a writer's error
		reader  string              // in a reader's log
		logged  string              // in a writer's log
	}{
		{name: "created by Open"},
		{name: "compacted", configs: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "compact"}},
			refused: "cleanup.policy=compact", reader: `level=WARN msg="the posterior log is compacted"`},
		{name: "compacted and deleted", configs: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "compact,delete"},
			{ConfigName: "retention.ms", ConfigValue: "-1"}, {ConfigName: "retention.bytes", ConfigValue: "-1"}},
			refused: "cleanup.policy=compact,delete", reader: `level=WARN msg="the posterior log is compacted"`},
		{name: "a retention", configs: []kafka.ConfigEntry{{ConfigName: "cleanup.policy", ConfigValue: "delete"},
			{ConfigName: "retention.ms", ConfigValue: "3600000"}, {ConfigName: "retention.bytes", ConfigValue: "-1"}},
			logged: "retention.ms=3600000", reader: "retention.ms=3600000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			topic := "posterior." + strings.ReplaceAll(tc.name, " ", "-")
			if tc.configs != nil {
				res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{Topic: topic, NumPartitions: 1,
					ReplicationFactor: -1, ConfigEntries: tc.configs}}})
				if err == nil {
					err = res.Errors[topic]
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			var logs bytes.Buffer
			lg := slog.New(slog.NewTextHandler(&logs, nil))
			l, err := Open(ctx, conn, topic, keys, lg)
			switch {
			case tc.refused == "" && err != nil:
				t.Fatalf("Open: %v", err)
			case tc.refused != "" && err == nil:
				l.Close()
				t.Fatalf("Open of a topic with %v opened it; want a refusal", tc.configs)
			case tc.refused != "":
				for _, want := range []string{"replication.posterior_topic " + topic, tc.refused, "--add-config cleanup.policy=delete"} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("Open's refusal %q does not say %q", err, want)
					}
				}
				if w, err := OpenExistingWriter(ctx, conn, topic, keys, lg); err == nil {
					w.Close()
					t.Error("OpenExistingWriter opened a compacted topic; want a refusal")
				}
			default:
				l.Close()
			}
			if !strings.Contains(logs.String(), tc.logged) || tc.logged == "" && strings.Contains(logs.String(), "level=ERROR") {
				t.Errorf("a writer's log:\n%s\nwant %q and no other ERROR line", logs.String(), tc.logged)
			}
			logs.Reset()
			r, err := OpenExisting(ctx, conn, topic, lg)
			if err != nil {
				t.Fatalf("OpenExisting: %v", err)
			}
			r.Close()
			if !strings.Contains(logs.String(), tc.reader) || tc.reader == "" && logs.Len() > 0 {
				t.Errorf("a reader's log:\n%s\nwant %q", logs.String(), tc.reader)
			}
		})
	}
}

// The tests' kafka-go readers wait as cfguard's do: kafkatest cannot import this package (its
// tests import kafkatest), so the two constants are kept equal here.
func TestTestReadersWaitAsCfguardsDo(t *testing.T) {
	if ReaderMaxWait != kafkatest.MaxWait {
		t.Fatalf("postlog.ReaderMaxWait %v, kafkatest.MaxWait %v: keep them equal", ReaderMaxWait, kafkatest.MaxWait)
	}
}
