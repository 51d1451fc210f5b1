package ceshare

import (
	"context"
	"testing"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/cfguard/cfguard/internal/kafkatest"
)

// NewMember creates the CE topic with the configured partition count and keeps its requests for
// ever (no time nor size retention, deletion not compaction): a new owner of a partition rebuilds
// its share from offset 0. A second member finds it and creates nothing.
func TestNewMemberCreatesTheCETopicKeptForEver(t *testing.T) {
	_, conn := startBroker(t)
	for range 2 {
		if _, err := NewMember(context.Background(), memberConfig(conn, "r1"), newLedger(), testLog(t)); err != nil {
			t.Fatal(err)
		}
	}
	cl := &kafka.Client{Addr: kafka.TCP(conn.Brokers...), Transport: kafkatest.Transport(t)}
	if n, err := topicPartitions(context.Background(), cl, testTopic); err != nil || n != testPartitions {
		t.Fatalf("the CE topic has %d partitions (%v), want %d", n, err, testPartitions)
	}
	want := map[string]string{"retention.ms": "-1", "retention.bytes": "-1", "cleanup.policy": "delete"}
	var names []string
	for n := range want {
		names = append(names, n)
	}
	res, err := cl.DescribeConfigs(context.Background(), &kafka.DescribeConfigsRequest{Resources: []kafka.DescribeConfigRequestResource{{
		ResourceType: kafka.ResourceTypeTopic, ResourceName: testTopic, ConfigNames: names}}})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, r := range res.Resources {
		if r.Error != nil {
			t.Fatal(r.Error)
		}
		for _, e := range r.ConfigEntries {
			got[e.ConfigName] = e.ConfigValue
		}
	}
	for n, v := range want {
		if got[n] != v {
			t.Errorf("the CE topic's %s is %q, want %q", n, got[n], v)
		}
	}
}

// partitionOffsets fails when the broker's answer for the partition is an error: offsets of 0
// would make a gap or a topic created again (outOfRange) of a broker that could not answer.
func TestPartitionOffsetsFailsOnThePartitionsError(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(testPartitions, testTopic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	failPartitions(t, kc, kmsg.ListOffsets, kafka.NotLeaderForPartition, nil)
	cl := &kafka.Client{Addr: kafka.TCP(kc.ListenAddrs()...), Transport: kafkatest.Transport(t)}
	if first, end, err := partitionOffsets(context.Background(), cl, testTopic, 3); err == nil {
		t.Errorf("partitionOffsets with the partition's error: %d, %d, nil; want an error", first, end)
	}
}
