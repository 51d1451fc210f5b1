package broker_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/cfguard/cfguard/internal/kafkatest"

	"github.com/cfguard/cfguard/broker"
	"github.com/cfguard/cfguard/internal/testnet"
	"github.com/cfguard/cfguard/internal/waitfor"
)

// byKey sends a message to the partition its key names (the key is the partition's number), so
// that a test knows where each record lands.
var byKey = kafka.BalancerFunc(func(m kafka.Message, partitions ...int) int {
	p, _ := strconv.Atoi(string(m.Key))
	return p
})

// produceTo writes one message per value, value i to partition i mod partitions, through the
// node at addr.
func produceTo(t *testing.T, addr, topic string, partitions int, values []string) {
	t.Helper()
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Topic: topic, Balancer: byKey, RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	msgs := make([]kafka.Message, len(values))
	for i, v := range values {
		msgs[i] = kafka.Message{Key: []byte(strconv.Itoa(i % partitions)), Value: []byte(v)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, msgs...); err != nil {
		t.Fatalf("produce to %s via %s: %v", topic, addr, err)
	}
}

// readPartitions reads every partition of topic from offset 0 through the node at addr until
// partition p has given want[p] messages, and returns the values by partition.
func readPartitions(t *testing.T, addr, topic string, want []int64) [][]string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	got := make([][]string, len(want))
	for p, n := range want {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: []string{addr}, Topic: topic, Partition: p, MaxWait: kafkatest.MaxWait})
		for int64(len(got[p])) < n {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				r.Close()
				t.Fatalf("reading %s/%d via %s after %d messages: %v", topic, p, addr, len(got[p]), err)
			}
			got[p] = append(got[p], string(m.Value))
		}
		r.Close()
	}
	return got
}

// metadataLeaders asks the node at addr for topic's metadata and returns each partition's
// leader address as that node reports it.
func metadataLeaders(t *testing.T, addr, topic string) []string {
	t.Helper()
	conn, err := kafka.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	parts, err := conn.ReadPartitions(topic)
	if err != nil {
		t.Fatalf("metadata of %s via %s: %v", topic, addr, err)
	}
	leaders := make([]string, len(parts))
	for _, p := range parts {
		leaders[p.ID] = net.JoinHostPort(p.Leader.Host, strconv.Itoa(p.Leader.Port))
	}
	return leaders
}

func TestSeveralNodesServeOneCluster(t *testing.T) {
	const nodes, partitions = 3, 6
	dir := t.TempDir()
	// "quiet" never gets a record: kfake persists the leader of a partition only with records.
	cfg := broker.Config{Nodes: nodes, DataDir: dir, SyncWrites: true, Topics: []string{"records", "quiet"}, Partitions: partitions}
	b := start(t, context.Background(), cfg)
	addrs := b.Addrs()
	if len(addrs) != nodes || len(slices.Compact(slices.Sorted(slices.Values(addrs)))) != nodes {
		t.Fatalf("Addrs() = %v, want %d distinct addresses", addrs, nodes)
	}
	if err := b.Healthy(); err != nil {
		t.Fatalf("Healthy() = %v", err)
	}
	// Partition p is led by node p mod 3, and every node says so to clients.
	if got := b.Leaders("records"); fmt.Sprint(got) != "[0 1 2 0 1 2]" {
		t.Fatalf("Leaders = %v, want [0 1 2 0 1 2]", got)
	}
	for _, a := range addrs {
		got := metadataLeaders(t, a, "records")
		for p, l := range got {
			if l != addrs[p%nodes] {
				t.Fatalf("node %s reports leader %s for partition %d, want %s", a, l, p, addrs[p%nodes])
			}
		}
	}

	// Produce through node 0, read back through node 2: the clients follow the leaders.
	var want []string
	for i := range 60 {
		want = append(want, fmt.Sprintf("v%d", i))
	}
	produceTo(t, addrs[0], "records", partitions, want)
	hw := b.HighWatermarks("records")
	if fmt.Sprint(hw) != "[10 10 10 10 10 10]" {
		t.Fatalf("high watermarks = %v, want 10 per partition", hw)
	}
	got := readPartitions(t, addrs[2], "records", hw)
	for p, vs := range got {
		for j, v := range vs {
			if w := want[p+j*partitions]; v != w {
				t.Fatalf("partition %d offset %d = %q, want %q", p, j, v, w)
			}
		}
	}

	// Restart on the same data directory with the same nodes: records and leaders come back.
	b.Close()
	b2 := start(t, context.Background(), cfg)
	for _, topic := range cfg.Topics {
		if got := b2.Leaders(topic); fmt.Sprint(got) != "[0 1 2 0 1 2]" {
			t.Fatalf("Leaders of %s after restart = %v, want [0 1 2 0 1 2]", topic, got)
		}
	}
	if got2 := readPartitions(t, b2.Addrs()[1], "records", hw); fmt.Sprint(got2) != fmt.Sprint(got) {
		t.Fatalf("after restart read %v, want %v", got2, got)
	}
	produceTo(t, b2.Addrs()[1], "records", partitions, []string{"w0", "w1", "w2", "w3", "w4", "w5"})
	if hw := b2.HighWatermarks("records"); fmt.Sprint(hw) != "[11 11 11 11 11 11]" {
		t.Fatalf("offsets continue after restart: high watermarks %v, want 11 per partition", hw)
	}
	b2.Close()

	// Restart with fewer nodes: the partitions node 2 led move to the others, nothing is lost.
	cfg.Nodes = 2
	b3 := start(t, context.Background(), cfg)
	for p, n := range b3.Leaders("records") {
		if n < 0 || n > 1 {
			t.Fatalf("partition %d led by node %d of 2", p, n)
		}
	}
	got3 := readPartitions(t, b3.Addrs()[1], "records", []int64{11, 11, 11, 11, 11, 11})
	for p := range partitions {
		if got3[p][10] != fmt.Sprintf("w%d", p) || fmt.Sprint(got3[p][:10]) != fmt.Sprint(got[p]) {
			t.Fatalf("partition %d on 2 nodes: %v", p, got3[p])
		}
	}
}

// startOnUnassigned starts a broker of nodes on consecutive ports below the kernel's ephemeral
// range (testnet.Unassigned): the broker binds them itself, since binding the ports it is given
// is what the test checks, and no socket takes such a port unless it names it.
func startOnUnassigned(t *testing.T, nodes int) (*broker.Broker, broker.Config) {
	t.Helper()
	cfg := broker.Config{Listen: net.JoinHostPort("127.0.0.1", strconv.Itoa(testnet.Unassigned(t, nodes))), Nodes: nodes}
	b, err := broker.Start(context.Background(), cfg, testLogger(t))
	if err != nil {
		t.Fatalf("start on %s: %v", cfg.Listen, err)
	}
	t.Cleanup(b.Close)
	return b, cfg
}

func TestNodesOnConsecutivePorts(t *testing.T) {
	b, cfg := startOnUnassigned(t, 3)
	base := must(strconv.Atoi(cfg.Listen[strings.LastIndexByte(cfg.Listen, ':')+1:]))
	want := fmt.Sprintf("[127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d]", base, base+1, base+2)
	if got := fmt.Sprint(b.Addrs()); got != want {
		t.Fatalf("Addrs() = %s, want %s", got, want)
	}
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func TestNodeThatCannotListenFailsStart(t *testing.T) {
	// Node 0's socket listens on a port below the kernel's ephemeral range (testnet.Unassigned)
	// and node 1's port, the next one, is busy: Start fails naming node 1, and node 0's socket is
	// closed (connections to its port are refused again; no other socket takes such a port
	// unless it names it).
	base := testnet.Unassigned(t, 2)
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(base))
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	busy, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+1)))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	b, err := broker.Start(context.Background(), broker.Config{Listen: addr, Listener: ln, Nodes: 2, DataDir: t.TempDir()}, nil)
	if err == nil {
		b.Close()
		t.Fatal("Start succeeded with node 1's port taken")
	}
	if !strings.Contains(err.Error(), "node 1") || !strings.Contains(err.Error(), "address already in use") {
		t.Fatalf("error %q does not name node 1 and the busy port", err)
	}
	c, err := net.Dial("tcp", addr)
	if err == nil {
		c.Close()
		t.Fatalf("node 0's socket on %s still accepts connections after the failed start", addr)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("dialling node 0's %s after the failed start: %v, want connection refused", addr, err)
	}
}

func TestSeveralNodesConfigRejected(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  broker.Config
		want string
	}{
		{"too many nodes", broker.Config{Nodes: broker.MaxNodes + 1}, "Nodes"},
		{"negative nodes", broker.Config{Nodes: -1}, "Nodes"},
		{"ports past 65535", broker.Config{Listen: "127.0.0.1:65535", Nodes: 2}, "65535"},
		{"negative session timeout", broker.Config{GroupMinSessionTimeout: -time.Second}, "GroupMinSessionTimeout"},
		{"session timeout past the maximum", broker.Config{GroupMinSessionTimeout: 6 * time.Minute}, "GroupMinSessionTimeout"},
		{"public address", broker.Config{Listen: "192.0.2.1:9092", Nodes: 3}, "loopback"},
		{"port not a number", broker.Config{Listen: "127.0.0.1:http"}, "port"},
		{"port past 65535", broker.Config{Listen: "127.0.0.1:70000"}, "port"},
		{"negative port", broker.Config{Listen: "127.0.0.1:-1"}, "port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := broker.Start(context.Background(), tc.cfg, nil)
			if err == nil {
				b.Close()
				t.Fatal("Start accepted a bad config")
			}
			if !strings.Contains(err.Error(), tc.want) || !errors.Is(err, broker.ErrInvalidConfig) {
				t.Fatalf("error %q does not mention %q or is not ErrInvalidConfig", err, tc.want)
			}
		})
	}
}

// groupState describes group through the node at addr: its state and each member's assigned
// partitions of topic.
func groupState(t *testing.T, addr, group, topic string) (string, map[string][]int) {
	t.Helper()
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addr), Timeout: 5 * time.Second}
	resp, err := cl.DescribeGroups(context.Background(), &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil || len(resp.Groups) != 1 || resp.Groups[0].Error != nil {
		return fmt.Sprintf("unknown (%v %v)", err, resp), nil
	}
	g := resp.Groups[0]
	members := make(map[string][]int)
	for _, m := range g.Members {
		members[m.MemberID] = nil
		for _, tp := range m.MemberAssignments.Topics {
			if tp.Topic == topic {
				members[m.MemberID] = append(members[m.MemberID], tp.Partitions...)
			}
		}
	}
	return g.GroupState, members
}

// stable reports whether group is stable with n members that share all partitions of topic,
// each holding at least one.
func stable(t *testing.T, addr, group, topic string, n, partitions int) (bool, map[string][]int) {
	state, members := groupState(t, addr, group, topic)
	if state != "Stable" || len(members) != n {
		return false, members
	}
	var all []int
	for _, ps := range members {
		if len(ps) == 0 {
			return false, members
		}
		all = append(all, ps...)
	}
	slices.Sort(all)
	return len(all) == partitions && len(slices.Compact(all)) == partitions, members
}

func TestGroupWithShortSessionTimeout(t *testing.T) {
	const partitions = 6
	b := start(t, context.Background(), broker.Config{Nodes: 3, GroupMinSessionTimeout: time.Second, Topics: []string{"events"}, Partitions: partitions})
	addrs := b.Addrs()
	reader := func(addr string) *kafka.Reader {
		cfg := kafka.ReaderConfig{Brokers: []string{addr}, GroupID: "g", Topic: "events", MaxWait: kafkatest.MaxWait,
			SessionTimeout: time.Second, HeartbeatInterval: 100 * time.Millisecond, RebalanceTimeout: 2 * time.Second, JoinGroupBackoff: 200 * time.Millisecond,
			StartOffset: kafka.FirstOffset}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		r := kafka.NewReader(cfg)
		t.Cleanup(func() { r.Close() })
		return r
	}
	// Two members, bootstrapped from different nodes, with a 1 s session timeout (refused by a
	// broker at Kafka's 6 s minimum), share the six partitions.
	r1, r2 := reader(addrs[1]), reader(addrs[2])
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fetched := make(chan string, 64)
	go func() {
		for {
			m, err := r2.FetchMessage(ctx)
			if err != nil {
				return
			}
			fetched <- string(m.Value)
		}
	}()
	var members map[string][]int
	waitfor.Cond(t, 30*time.Second, "two members sharing the partitions", func() bool {
		ok, m := stable(t, addrs[0], "g", "events", 2, partitions)
		members = m
		return ok
	})
	t.Logf("assignment with two members: %v", members)

	// r1 closes (and leaves): r2 gets all six partitions, and reads what is produced to each.
	r1.Close()
	var survivor string
	waitfor.Cond(t, 30*time.Second, "one member holding every partition", func() bool {
		ok, m := stable(t, addrs[0], "g", "events", 1, partitions)
		for id := range m {
			survivor = id
		}
		return ok
	})
	if _, ok := members[survivor]; !ok {
		t.Fatalf("the member left is %s, not one of %v", survivor, members)
	}
	values := []string{"e0", "e1", "e2", "e3", "e4", "e5"}
	produceTo(t, addrs[0], "events", partitions, values)
	seen := map[string]bool{}
	waitfor.Cond(t, 30*time.Second, "the remaining member reading every partition", func() bool {
		for {
			select {
			case v := <-fetched:
				seen[v] = true
			default:
				return len(seen) == len(values)
			}
		}
	})

	// A member that joins and then never heartbeats is dropped after its 1 s session: the group
	// settles back on r2 alone.
	cl := &kafka.Client{Transport: kafkatest.Transport(t), Addr: kafka.TCP(addrs[0]), Timeout: 10 * time.Second}
	join := &kafka.JoinGroupRequest{GroupID: "g", SessionTimeout: time.Second, RebalanceTimeout: 2 * time.Second,
		ProtocolType: "consumer", Protocols: []kafka.GroupProtocol{{Name: "range", Metadata: kafka.GroupProtocolSubscription{Topics: []string{"events"}}}}}
	resp, err := cl.JoinGroup(context.Background(), join)
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	if errors.Is(resp.Error, kafka.MemberIDRequired) {
		join.MemberID = resp.MemberID
		if resp, err = cl.JoinGroup(context.Background(), join); err != nil {
			t.Fatalf("join with member id: %v", err)
		}
	}
	if resp.Error != nil {
		t.Fatalf("join: %v", resp.Error)
	}
	t.Logf("silent member %s joined generation %d", resp.MemberID, resp.GenerationID)
	// (r2's kafka-go may leave and rejoin under a new member id while the silent member stalls
	// the rebalance, so the member left is identified as "not the silent one".)
	took := waitfor.Cond(t, 30*time.Second, "the silent member dropped and one member holding every partition", func() bool {
		ok, m := stable(t, addrs[0], "g", "events", 1, partitions)
		_, silent := m[resp.MemberID]
		return ok && !silent
	})
	t.Logf("the group settled without the silent member after %v", took.Round(time.Millisecond))
}

func TestSeveralNodesApplyRetention(t *testing.T) {
	// Records older than the retention are deleted on every partition, whichever node leads it.
	const partitions = 6
	b := start(t, context.Background(), broker.Config{Nodes: 3, DataDir: t.TempDir(), Topics: []string{"records"}, Partitions: partitions,
		Retention: time.Hour, RetentionCheckInterval: time.Hour})
	w := &kafka.Writer{Transport: kafkatest.Transport(t), Addr: kafka.TCP(b.Addrs()[1]), Topic: "records", Balancer: byKey, RequiredAcks: kafka.RequireAll, BatchTimeout: time.Millisecond}
	defer w.Close()
	var msgs []kafka.Message
	for i := range 2 * partitions {
		at := time.Now()
		if i < partitions {
			at = at.Add(-2 * time.Hour) // the first record of each partition is past retention
		}
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(i % partitions)), Value: []byte(fmt.Sprint(i)), Time: at})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, m := range msgs { // one at a time: each batch has its own timestamp
		if err := w.WriteMessages(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	if got := b.LogStartOffsets("records"); fmt.Sprint(got) != "[0 0 0 0 0 0]" {
		t.Fatalf("log start offsets before retention = %v", got)
	}
	b.ApplyRetention()
	if got := b.LogStartOffsets("records"); fmt.Sprint(got) != "[1 1 1 1 1 1]" {
		t.Fatalf("log start offsets after retention = %v, want 1 per partition", got)
	}
}
