package ceshare

import (
	"context"
	"errors"
	"fmt"

	"github.com/cfguard/cfguard/stream"
	"github.com/segmentio/kafka-go"
)

// PartitionsMismatchError is returned when the CE topic exists with another partition count
// than the configured one. A CE's partition is murmur2(id) mod the count, so replicas that
// disagree on it would look for CEs in the wrong partitions.
type PartitionsMismatchError struct {
	Topic            string
	Have, Configured int
}

func (e *PartitionsMismatchError) Error() string {
	return fmt.Sprintf("ceshare: topic %q has %d partitions, replication.ce_partitions is %d: set replication.ce_partitions to %d "+
		"(partitions cannot be removed, and adding some would move CEs to other partitions)", e.Topic, e.Have, e.Configured, e.Have)
}

// topicPartitions returns the partition count of topic, 0 when it does not exist.
func topicPartitions(ctx context.Context, cl *kafka.Client, topic string) (int, error) {
	md, err := cl.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return 0, fmt.Errorf("ceshare: describing topic %q: %w", topic, err)
	}
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if errors.Is(t.Error, kafka.UnknownTopicOrPartition) {
			return 0, nil
		}
		if t.Error != nil {
			return 0, fmt.Errorf("ceshare: describing topic %q: %w", topic, t.Error)
		}
		return len(t.Partitions), nil
	}
	return 0, nil
}

// ensureTopic creates topic with partitions partitions, kept for ever (a new owner of a
// partition reads its requests from offset 0), unless it exists; an existing topic must have
// partitions partitions.
func ensureTopic(ctx context.Context, cl *kafka.Client, topic string, partitions int) (created bool, err error) {
	return ensure(ctx, cl, topic, partitions, []kafka.ConfigEntry{
		{ConfigName: "retention.ms", ConfigValue: "-1"},
		{ConfigName: "retention.bytes", ConfigValue: "-1"},
		{ConfigName: "cleanup.policy", ConfigValue: "delete"},
	})
}

// ensure creates topic with partitions partitions and configs unless it exists; an existing
// topic must have partitions partitions.
func ensure(ctx context.Context, cl *kafka.Client, topic string, partitions int, configs []kafka.ConfigEntry) (created bool, err error) {
	have, err := topicPartitions(ctx, cl, topic)
	if err != nil {
		return false, err
	}
	if have == 0 {
		if created, err := create(ctx, cl, topic, partitions, configs); err != nil || created {
			return created, err
		}
		// Another replica created it first.
		if have, err = topicPartitions(ctx, cl, topic); err != nil {
			return false, err
		}
	}
	if have != partitions {
		return false, &PartitionsMismatchError{Topic: topic, Have: have, Configured: partitions}
	}
	return false, nil
}

// create asks the controller to create topic (what the client's cached metadata says of it does
// not matter): created is false when it exists already.
func create(ctx context.Context, cl *kafka.Client, topic string, partitions int, configs []kafka.ConfigEntry) (created bool, err error) {
	res, err := cl.CreateTopics(ctx, &kafka.CreateTopicsRequest{Topics: []kafka.TopicConfig{{
		Topic: topic, NumPartitions: partitions, ReplicationFactor: -1, ConfigEntries: configs,
	}}})
	if err != nil {
		return false, fmt.Errorf("ceshare: creating topic %q with %d partitions: %w", topic, partitions, err)
	}
	switch err := res.Errors[topic]; {
	case err == nil:
		return true, nil
	case errors.Is(err, kafka.TopicAlreadyExists):
		return false, nil
	default:
		return false, fmt.Errorf("ceshare: creating topic %q with %d partitions: %w", topic, partitions, err)
	}
}

// partitionOffsets is the first offset and the end (the high watermark) of partition p of topic.
func partitionOffsets(ctx context.Context, cl *kafka.Client, topic string, p int) (first, end int64, err error) {
	res, err := cl.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{
		topic: {kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p)}}})
	if err != nil {
		return 0, 0, fmt.Errorf("ceshare: listing offsets of partition %d of %q: %w", p, topic, err)
	}
	for _, po := range res.Topics[topic] {
		if po.Partition != p {
			continue
		}
		if po.Error != nil {
			return 0, 0, fmt.Errorf("ceshare: listing offsets of partition %d of %q: %w", p, topic, stream.OffsetsError(po.Error))
		}
		return po.FirstOffset, po.LastOffset, nil
	}
	return 0, 0, fmt.Errorf("ceshare: listing offsets of partition %d of %q: no answer for it", p, topic)
}
