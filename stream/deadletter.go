package stream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/cfguard/cfguard/internal/backoff"
	"github.com/segmentio/kafka-go"
)

// Dead-letter headers. A dead letter carries these first, then the source record's headers
// except its own cfguard-* ones (a dead letter replayed to the topic and dead-lettered again
// carries one of each, the new one). The source's key, value and headers are copied as they
// were, cut where they pass the bounds below; a HeaderTruncated* header then gives the size
// that was cut.
const (
	HeaderReason           = "cfguard-reason"            // a Reason* code
	HeaderError            = "cfguard-error"             // human detail
	HeaderSourceTopic      = "cfguard-source-topic"      // where the record was read
	HeaderSourcePartition  = "cfguard-source-partition"  // decimal
	HeaderSourceOffset     = "cfguard-source-offset"     // decimal
	HeaderTruncated        = "cfguard-truncated"         // original value size, when the value was cut
	HeaderTruncatedKey     = "cfguard-truncated-key"     // original key size, when the key was cut
	HeaderTruncatedHeaders = "cfguard-truncated-headers" // size of the source's headers (names and values), when some were left out
)

// Bounds of a dead letter, so that one always fits a produce request of the dead-letter
// writer (writerBatchBytes) whatever the source record (up to the broker's 1 MB limit, key and
// headers included) was.
const (
	// maxDeadLetterValue bounds the value copied to the dead-letter topic; longer values are
	// cut and HeaderTruncated set.
	maxDeadLetterValue = 256 << 10
	// maxDeadLetterKey bounds the key copied; longer keys are cut and HeaderTruncatedKey set.
	maxDeadLetterKey = 16 << 10
	// maxDeadLetterHeaders bounds the source headers copied (names, values and
	// headerOverhead each): they are copied in order while they fit, the rest are left out and
	// HeaderTruncatedHeaders set.
	maxDeadLetterHeaders = 64 << 10
	// maxDeadLetterDetail bounds HeaderError; a longer detail is cut and ends with "...".
	maxDeadLetterDetail = 1 << 10
	// headerOverhead bounds the bytes a record spends on one header besides its name and value
	// (two varint lengths).
	headerOverhead = 10
	// writerBatchBytes bounds a produce request (Kafka's and kfake's default limit is 1048588).
	writerBatchBytes = 1_000_000
)

// A dead letter's cfguard headers (a Kafka topic name is at most 249 bytes) take well under
// 2 KiB besides the detail: the bounds above leave room within writerBatchBytes (this does not
// compile otherwise).
const _ = uint(writerBatchBytes - (maxDeadLetterValue + maxDeadLetterKey + maxDeadLetterHeaders + maxDeadLetterDetail + 2<<10))

// newWriter is a synchronous writer that waits for all in-sync replicas. Batching comes from
// the caller passing many messages to one WriteMessages call, so the batch timeout is short.
// Its own error lines go to errLog.
func newWriter(brokers []string, topic string, tr *kafka.Transport, errLog kafka.Logger) *kafka.Writer {
	return &kafka.Writer{
		Addr:         kafka.TCP(brokers...),
		Topic:        topic,
		Balancer:     &kafka.Hash{},
		RequiredAcks: kafka.RequireAll,
		BatchSize:    1000,
		BatchBytes:   writerBatchBytes,
		BatchTimeout: time.Millisecond,
		MaxAttempts:  3,
		Transport:    tr,
		ErrorLogger:  errLog,
	}
}

// headerPrefix starts the name of every header cfguard writes to a dead letter.
const headerPrefix = "cfguard-"

// deadLetterMessage is the dead letter of the record at offset of topic's partition part
// (see the Header* constants).
func deadLetterMessage(topic string, part int, offset int64, key, value []byte, headers []kafka.Header, at time.Time, de *DecodeError) kafka.Message {
	h := make([]kafka.Header, 0, 8+len(headers))
	h = append(h,
		kafka.Header{Key: HeaderReason, Value: []byte(de.Reason)},
		kafka.Header{Key: HeaderError, Value: []byte(cutText(de.Detail, maxDeadLetterDetail))},
		kafka.Header{Key: HeaderSourceTopic, Value: []byte(topic)},
		kafka.Header{Key: HeaderSourcePartition, Value: strconv.AppendInt(nil, int64(part), 10)},
		kafka.Header{Key: HeaderSourceOffset, Value: strconv.AppendInt(nil, offset, 10)},
	)
	if len(key) > maxDeadLetterKey {
		h = append(h, kafka.Header{Key: HeaderTruncatedKey, Value: strconv.AppendInt(nil, int64(len(key)), 10)})
		key = key[:maxDeadLetterKey]
	}
	if len(value) > maxDeadLetterValue {
		h = append(h, kafka.Header{Key: HeaderTruncated, Value: strconv.AppendInt(nil, int64(len(value)), 10)})
		value = value[:maxDeadLetterValue]
	}
	var kept []kafka.Header
	size, total, whole := 0, 0, true
	for _, sh := range headers {
		if strings.HasPrefix(sh.Key, headerPrefix) { // those of an earlier dead-lettering
			continue
		}
		total += len(sh.Key) + len(sh.Value)
		if n := len(sh.Key) + len(sh.Value) + headerOverhead; whole && size+n <= maxDeadLetterHeaders {
			kept, size = append(kept, sh), size+n
		} else {
			whole = false
		}
	}
	if !whole {
		h = append(h, kafka.Header{Key: HeaderTruncatedHeaders, Value: strconv.AppendInt(nil, int64(total), 10)})
	}
	h = append(h, kept...)
	return kafka.Message{Key: key, Value: value, Headers: h, Time: at}
}

// cutText returns s cut to at most n bytes at a UTF-8 character boundary, ending with "..."
// when it was cut.
func cutText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := n - len("...")
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + "..."
}

// writeDead writes ch's dead letters, retrying what failed with backoff until ctx ends. Dead
// letters that the topic refuses as too large together are written again one per request. A
// dead letter it refuses as too large on its own, or an error no retry fixes (see permanent),
// stops the consumer with an error that names the source records and how to recover. It
// returns false when the reader must stop (ctx ended, the consumer is closing, or it stopped).
// Its failures are an outage source of the partition's own, so that another partition's
// dead letters written meanwhile do not end the outage.
func (c *Consumer) writeDead(ctx context.Context, ch *chunk) bool {
	src := deadLetterSource(ch.part)
	bo := backoff.Backoff{Min: c.cfg.RetryMin, Max: c.cfg.RetryMax}
	todo := ch.deadMarksAndMsgs()
	single := false // one dead letter per request: together they were too large for the topic
	for len(todo) > 0 {
		batch := todo
		if single {
			batch = todo[:1]
		}
		msgs := make([]kafka.Message, len(batch))
		for i, d := range batch {
			msgs[i] = d.msg
		}
		w := c.dlq
		if single {
			w = c.dlqOne
		}
		err := w.WriteMessages(ctx, msgs...)
		failed, errs := failedDead(batch, err)
		c.countDead(batch, failed)
		todo = append(failed, todo[len(batch):]...)
		switch i := slices.IndexFunc(errs, TooLarge); {
		case err == nil:
			c.out.ok(src)
			c.deadWriteFailing(ch.part, nil)
		case ctx.Err() != nil:
			return false
		case i >= 0 && len(batch) > 1:
			single = true // they may fit one by one
		case i >= 0:
			c.fail(c.deadTooLarge(ch.part, failed[i], errs[i]))
			return false
		case !retryable(err):
			c.fail(fmt.Errorf("stream: the dead letters of %s partition %d at offsets %d to %d cannot be written to the dead-letter topic %s: %w; "+
				"fix the topic, or the client's permission to write to it, then restart the daemon: the partition is read again from its "+
				"checkpoint, at or before offset %d", c.cfg.Topic, ch.part, failed[0].offset, failed[len(failed)-1].offset,
				c.cfg.DeadLetterTopic, err, failed[0].offset))
			return false
		default:
			c.failedAttempt(src, err)
			c.deadWriteFailing(ch.part, err)
			if bo.Wait(ctx) != nil {
				return false
			}
		}
	}
	ch.deadMsgs = nil
	return true
}

// deadWriteFailing notes that a dead-letter write of partition part failed with err, or, with a
// nil err, that one succeeded (see partState.deadFailing).
func (c *Consumer) deadWriteFailing(part int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ps := c.parts[part]
	switch {
	case ps == nil:
	case err == nil:
		ps.deadFailing, ps.deadErr = time.Time{}, nil
	default:
		if ps.deadFailing.IsZero() {
			ps.deadFailing = time.Now()
		}
		ps.deadErr = err
	}
}

// summarizeDead logs how many dead letters were counted and not logged since the last summary,
// if any (c.deadMu held).
func (c *Consumer) summarizeDead() {
	if c.deadSuppressed == 0 {
		return
	}
	c.log.Warn("more records dead-lettered than logged one by one", "not_logged", c.deadSuppressed,
		"window", c.cfg.deadLogWindow, "dead_letter_topic", c.cfg.DeadLetterTopic)
	c.deadSuppressed = 0
}

// deadWindowEnded is the timer logDead sets when a window's burst is spent.
func (c *Consumer) deadWindowEnded() {
	c.deadMu.Lock()
	defer c.deadMu.Unlock()
	c.deadTimer = nil
	if !c.deadClosed {
		c.summarizeDead()
	}
}

// closeDeadLog stops the window's timer and logs what it would have (at Close: no dead letter is
// counted after it).
func (c *Consumer) closeDeadLog() {
	c.deadMu.Lock()
	defer c.deadMu.Unlock()
	c.deadClosed = true
	if c.deadTimer != nil {
		c.deadTimer.Stop()
		c.deadTimer = nil
	}
	c.summarizeDead()
}

// deadLetterSource names the outage of partition part's dead-letter writes.
func deadLetterSource(part int) string { return "dead-letter write, partition " + strconv.Itoa(part) }

// failedDead returns the dead letters of batch that WriteMessages did not write (it returned
// err), in order, and the error of each.
func failedDead(batch []pendingDead, err error) ([]pendingDead, []error) {
	var (
		failed []pendingDead
		errs   []error
		werrs  kafka.WriteErrors
	)
	switch {
	case err == nil:
	case errors.As(err, &werrs) && len(werrs) == len(batch):
		for i, e := range werrs {
			if e != nil {
				failed, errs = append(failed, batch[i]), append(errs, e)
			}
		}
	default: // nothing was written (kafka-go refused a message too large for its writer, or the topic's metadata failed)
		for _, d := range batch {
			failed, errs = append(failed, d), append(errs, err)
		}
	}
	return failed, errs
}

// TooLarge reports whether err refuses a message as too large: the topic's max.message.bytes
// (from the broker), or the writer's own limit (kafka-go's MessageTooLargeError wraps the same
// code); of a kafka.WriteErrors (which unwraps to none of its errors), whether one does.
func TooLarge(err error) bool {
	var we kafka.WriteErrors
	if errors.As(err, &we) {
		return slices.ContainsFunc(we, func(e error) bool { return e != nil && errors.Is(e, kafka.MessageSizeTooLarge) })
	}
	return errors.Is(err, kafka.MessageSizeTooLarge)
}

// deadTooLarge is the error that stops the consumer when the dead-letter topic refuses d, alone
// in its request, as too large.
func (c *Consumer) deadTooLarge(part int, d pendingDead, err error) error {
	need := batchBytes(d.msg)
	return fmt.Errorf("stream: the dead letter of %s partition %d offset %d is too large for the dead-letter topic %s (a record batch "+
		"of %d bytes at most): %w; raise the topic's max.message.bytes to %d or more, then restart the daemon: the partition is read "+
		"again from its checkpoint, at or before offset %d", c.cfg.Topic, part, d.offset, c.cfg.DeadLetterTopic, need, err, need, d.offset)
}

// batchBytes bounds the size of a v2 record batch holding m alone: 61 bytes of batch header,
// the record's own fixed fields and varint lengths (36 at most), its key, value and headers.
func batchBytes(m kafka.Message) int {
	n := 61 + 36 + len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += len(h.Key) + len(h.Value) + headerOverhead
	}
	return n
}

type pendingDead struct {
	offset int64 // of the source record
	reason string
	msg    kafka.Message
}

func (ch *chunk) deadMarksAndMsgs() []pendingDead {
	out := make([]pendingDead, len(ch.dead))
	for i, d := range ch.dead {
		out[i] = pendingDead{offset: d.offset, reason: d.reason, msg: ch.deadMsgs[i]}
	}
	return out
}

// Dead letters are logged one line each, up to deadLogBurst per window (ConsumerConfig's
// deadLogWindow, defaultDeadLogWindow); beyond that they are counted, and one summary line says
// how many were not logged: when the window ends (a timer, so that a burst followed by silence
// is reported too), and at Close.
const (
	deadLogBurst         = 10
	defaultDeadLogWindow = time.Minute
)

// countDead adds the written dead letters (all minus failed, which is a subsequence) to the
// per-reason totals, and logs them (see deadLogBurst).
func (c *Consumer) countDead(all, failed []pendingDead) {
	c.deadMu.Lock()
	defer c.deadMu.Unlock()
	for _, d := range all {
		c.dead[d.reason]++
	}
	for _, d := range failed {
		c.dead[d.reason]--
	}
	j := 0
	for _, d := range all {
		if j < len(failed) && sameSource(failed[j].msg, d.msg) {
			j++
			continue
		}
		c.logDead(d)
	}
}

// sameSource reports whether two dead letters come from the same source record.
func sameSource(a, b kafka.Message) bool {
	return headerValue(a, HeaderSourcePartition) == headerValue(b, HeaderSourcePartition) &&
		headerValue(a, HeaderSourceOffset) == headerValue(b, HeaderSourceOffset)
}

func headerValue(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// logDead logs one written dead letter, or counts it once the window's burst is spent (c.deadMu
// held).
func (c *Consumer) logDead(d pendingDead) {
	now := time.Now()
	if now.Sub(c.deadLogAt) >= c.cfg.deadLogWindow {
		c.summarizeDead()
		c.deadLogAt, c.deadLogged, c.deadSuppressed = now, 0, 0
	}
	if c.deadLogged >= deadLogBurst {
		if c.deadSuppressed == 0 && c.deadTimer == nil && !c.deadClosed {
			// Report the window's count when it ends, whether or not another dead letter comes.
			c.deadTimer = time.AfterFunc(c.deadLogAt.Add(c.cfg.deadLogWindow).Sub(now), c.deadWindowEnded)
		}
		c.deadSuppressed++
		return
	}
	c.deadLogged++
	c.log.Warn("record dead-lettered", "reason", d.reason, "error", headerValue(d.msg, HeaderError), // the logger names the topic
		"partition", headerValue(d.msg, HeaderSourcePartition),
		"offset", headerValue(d.msg, HeaderSourceOffset), "dead_letter_topic", c.cfg.DeadLetterTopic)
}
