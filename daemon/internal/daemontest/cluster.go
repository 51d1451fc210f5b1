package daemontest

import (
	"context"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/ceshare"
	"github.com/cfguard/cfguard/config"
	"github.com/cfguard/cfguard/dataset"
	"github.com/cfguard/cfguard/internal/kafkatest"
	"github.com/cfguard/cfguard/internal/waitfor"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/postlog"
	"github.com/cfguard/cfguard/stream"
)

// Views reads GET /v1/model of each replica.
func Views[S Server](t testing.TB, reps []*Running[S]) []ModelView {
	t.Helper()
	vs := make([]ModelView, len(reps))
	for i, r := range reps {
		vs[i] = r.Model(t)
	}
	return vs
}

// ProgressOf says where each replica is: what a wait on their work (waitfor.Progress) watches.
func ProgressOf(vs []ModelView) string {
	var b strings.Builder
	for _, v := range vs {
		fmt.Fprintf(&b, "updater %v, term %d, entry %d, version %d; ", v.Replication.Updater, v.Replication.Term, v.Replication.Entry, v.Version)
	}
	return b.String()
}

// ProduceRows produces n labelled records through r's broker, rows of data from the one after
// the from records already produced (cycling), and returns how many are produced then.
func ProduceRows[S Server](t testing.TB, r *Running[S], data *dataset.Set, from, n int) int {
	t.Helper()
	vals := make([][]byte, n)
	for i := range vals {
		k := (from + i) % data.Len()
		vals[i] = Record(fmt.Sprintf("rec-%d", from+i), data.X[k], data.Y[k])
	}
	r.Produce(t, vals...)
	return from + n
}

// StartCluster starts a broker on loopback, in memory, stopped at the test's end: the input
// topic with partitions partitions, the dead-letter and events topics, for replicas or for a
// daemon given an external broker.
func StartCluster(t testing.TB, partitions int) *broker.Broker {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b, err := broker.Start(ctx, broker.Config{Listen: "127.0.0.1:0", Partitions: partitions,
		Topics: []string{"cfguard.records", "cfguard.records.dlq", "cfguard.events"}}, nil)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close(); cancel() })
	return b
}

// StartFunc starts a daemon on Config(t, mutate) without waiting for it to be ready.
type StartFunc[S Server] func(t testing.TB, mutate func(c *config.Config)) *Running[S]

// StartReplica starts replica id of the cluster on the brokers at addrs with the key file
// keyFile, and waits until it is ready.
func StartReplica[S Server](t testing.TB, start StartFunc[S], addrs []string, id, keyFile string) *Running[S] {
	t.Helper()
	r := start(t, func(c *config.Config) { ReplicaConfig(c, addrs, id, keyFile) })
	return r.WaitReady(t, id+" ready", 60*time.Second)
}

// FirstOfTwoReplicas begins a parallel test of two replicas (what: what it needs, skipped with
// -short): a broker, the cluster's key file, and replica r1 ready on them.
func FirstOfTwoReplicas[S Server](t *testing.T, start StartFunc[S], what string) (*broker.Broker, string, *Running[S]) {
	t.Helper()
	if testing.Short() {
		t.Skip(what + ": not with -short")
	}
	t.Parallel()
	b := StartCluster(t, 1)
	key := WriteKeyFile(t, ClusterKey)
	return b, key, StartReplica(t, start, b.Addrs(), "r1", key)
}

// StartThreeReplicas starts replicas r1, r2, r3 on one broker and waits until the CE topic's
// partitions are shared out among them, each owner caught up with its partitions.
func StartThreeReplicas[S Server](t testing.TB, start StartFunc[S]) (*broker.Broker, []*Running[S]) {
	t.Helper()
	b := StartCluster(t, 1)
	key := WriteKeyFile(t, ClusterKey)
	reps := []*Running[S]{StartReplica(t, start, b.Addrs(), "r1", key), StartReplica(t, start, b.Addrs(), "r2", key),
		StartReplica(t, start, b.Addrs(), "r3", key)}
	parts := reps[0].D.Share().Partitions()
	waitfor.Cond(t, 90*time.Second, "every CE partition owned by one ready replica, each replica owning some", func() bool {
		owned := 0
		for _, r := range reps {
			if !ShareReady(r) {
				return false
			}
			owned += len(r.D.Share().Member().Owned())
		}
		return owned == parts
	})
	return b, reps
}

// Settled waits until the owner of id's CE partition has applied every request the partition
// holds, and returns what that owner stores under id (nil when nothing).
func Settled[S Server](t testing.TB, b *broker.Broker, reps []*Running[S], id string) *ledger.CE {
	t.Helper()
	s := reps[0].D.Share()
	topic := reps[0].Config.Replication.CETopic
	p := ceshare.Partition(id, s.Partitions())
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()...)}
	var owner *Running[S]
	waitfor.Cond(t, 30*time.Second, fmt.Sprintf("partition %d applied to its end by its owner", p), func() bool {
		res, err := cl.ListOffsets(context.Background(), &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
			topic: {kafka.LastOffsetOf(p)}}})
		if err != nil {
			return false
		}
		var end int64 = -1
		for _, po := range res.Topics[topic] {
			if po.Partition == p && po.Error == nil {
				end = po.LastOffset
			}
		}
		for _, r := range reps {
			m := r.D.Share().Member()
			if next, ok := m.Next(p); ok && m.Ready(p) && next >= end && end >= 0 {
				owner = r
				return true
			}
		}
		return false
	})
	ce, err := owner.D.Ledger().Get(id)
	if err != nil {
		return nil
	}
	return ce
}

// ShareReady reports whether replica r owns CE partitions and has read every one it owns.
func ShareReady[S Server](r *Running[S]) bool {
	m := r.D.Share().Member()
	own := m.Owned()
	if len(own) == 0 {
		return false
	}
	for _, p := range own {
		if !m.Ready(p) {
			return false
		}
	}
	return true
}

// RawProduce writes one record to a partition of topic as a client of the cluster that holds no
// cluster key would (kcat, a stray producer), and returns its offset.
func RawProduce(t testing.TB, b *broker.Broker, topic string, partition int, key string, value []byte, headers ...kafka.Header) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	tr := &kafka.Transport{}
	defer tr.CloseIdleConnections()
	cl := &kafka.Client{Addr: kafka.TCP(b.Addrs()...), Transport: tr}
	res, err := cl.Produce(ctx, &kafka.ProduceRequest{Topic: topic, Partition: partition, RequiredAcks: kafka.RequireAll,
		Records: kafka.NewRecordReader(kafka.Record{Time: time.Now(), Key: kafka.NewBytes([]byte(key)), Value: kafka.NewBytes(value), Headers: headers})})
	if err == nil {
		err = res.Error
	}
	if err != nil {
		t.Fatalf("producing a forged record to %s/%d: %v", topic, partition, err)
	}
	return res.BaseOffset
}

// ClusterKey is the key file line of the test replicas.
const ClusterKey = "k1:5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"

// WriteKeyFile writes a key file holding lines, one key each, and returns its path.
func WriteKeyFile(t testing.TB, lines ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// ReplicaConfig makes c a replica id of the cluster on the brokers at addrs, with the key file
// keyFile.
func ReplicaConfig(c *config.Config, addrs []string, id, keyFile string) {
	c.Kafka.Brokers = addrs
	c.Replication.Enabled = true
	c.Replication.ReplicaID = id
	c.Replication.SessionTimeout = 6 * time.Second // kfake's group.min.session.timeout.ms
	c.Replication.HeartbeatInterval = 500 * time.Millisecond
	c.Replication.KeyFile = keyFile
}

// KeyHolderLog opens r's posterior log with r's cluster key, as a writer holding the key would;
// it is closed when the test ends.
func KeyHolderLog[S Server](t testing.TB, r *Running[S]) *postlog.Log {
	t.Helper()
	plog, err := postlog.Open(context.Background(), stream.ConnConfig{Brokers: r.D.BrokerAddrs()}, "cfguard.posterior", r.D.Replica().Keys(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plog.Close() })
	return plog
}

// ClaimOn is a claim of the next term on head h by writer.
func ClaimOn(h *postlog.Head, writer string) *postlog.Entry {
	e := &postlog.Entry{Format: postlog.Format, Kind: postlog.Claim, Seq: h.Seq + 1, Parent: h.Hash, Term: h.Term + 1,
		Writer: writer, Version: h.Version, ParentVersion: h.Version, Covers: h.Covers, PosteriorSHA256: h.PosteriorSHA256}
	h.Lineage(e)
	return e
}

// AppendEntry writes e to the posterior log plog as a writer holding the cluster key would, and
// returns the hex SHA-256 of its value (the parent hash of its successor).
func AppendEntry(t testing.TB, plog *postlog.Log, e *postlog.Entry) string {
	t.Helper()
	v, err := e.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if err := plog.Append(context.Background(), fmt.Sprintf("e/%d", e.Seq), v); err != nil {
		t.Fatal(err)
	}
	sum := postlog.Hash(v)
	return hex.EncodeToString(sum[:])
}
