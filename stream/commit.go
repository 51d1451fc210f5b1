package stream

import (
	"context"
	"errors"
	"fmt"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/segmentio/kafka-go"
)

// commitLoop commits the durable offsets (MarkDurable) to the group in the background: at most
// one commit per CommitInterval, each carrying the latest durable offsets (earlier ones are
// superseded, not sent), retried with backoff until it succeeds.
func (c *Consumer) commitLoop(ctx context.Context) {
	bo := backoff.Backoff{Min: c.cfg.RetryMin, Max: c.cfg.RetryMax}
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.wake:
		}
		for c.commitDurable(ctx) != nil {
			if bo.Wait(ctx) != nil {
				return
			}
		}
		bo.Reset()
		if backoff.Sleep(ctx, c.cfg.CommitInterval) != nil {
			return
		}
	}
}

// commitDurable commits the durable offsets the group does not have yet, as a simple consumer:
// generation -1 and no member id. Kafka and kfake store such commits for a group without
// members; a group with members refuses them (UNKNOWN_MEMBER_ID or ILLEGAL_GENERATION), which
// is why GroupID must be unique per daemon.
func (c *Consumer) commitDurable(ctx context.Context) error {
	c.commitMu.Lock()
	var offs []kafka.OffsetCommit
	for p, off := range c.durable {
		if done, ok := c.committed[p]; !ok || done != off {
			offs = append(offs, kafka.OffsetCommit{Partition: p, Offset: off})
		}
	}
	c.commitMu.Unlock()
	if len(offs) == 0 {
		return nil
	}
	res, err := c.cl.OffsetCommit(ctx, &kafka.OffsetCommitRequest{GroupID: c.cfg.GroupID, GenerationID: -1,
		Topics: map[string][]kafka.OffsetCommit{c.cfg.Topic: offs}})
	if err == nil {
		for _, pr := range res.Topics[c.cfg.Topic] {
			if pr.Error != nil {
				err = fmt.Errorf("partition %d: %w", pr.Partition, pr.Error)
				break
			}
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		var ke kafka.Error
		if errors.As(err, &ke) { // the broker answered, and refused
			c.retries.Add(1)
			c.group.fail("commit", fmt.Errorf("group %q refuses the offsets of a consumer that is not its member (kafka.group_id must be unique per daemon; the commits are informational, reading goes on): %w", c.cfg.GroupID, err))
		} else {
			c.failedAttempt("group commit", err)
		}
		return err
	}
	c.answered()
	c.out.ok("group commit")
	c.group.ok("commit")
	c.commitMu.Lock() // one step for Stats: the commit is counted with the offsets it committed
	for _, o := range offs {
		c.committed[o.Partition] = o.Offset
	}
	c.commits.Add(1)
	c.commitMu.Unlock()
	return nil
}
