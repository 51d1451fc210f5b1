package stream

import (
	"github.com/cfguard/cfguard/broker"
	"slices"
	"testing"
	"time"
)

func TestConsumeGoodRecords(t *testing.T) {
	b := startBroker(t, broker.Config{})
	conn := plainConn(b)
	produce(t, conn, recordsTopic, 0, goodRecords("r", 10)...)
	start := time.Now()
	c := newConsumer(t, consumerConfig(conn, "g1"))
	incs := collect(t, c, 10, 20*time.Second)
	t.Logf("first 10 records after %v in %d increments", time.Since(start), len(incs))
	if got, want := ids(incs), []string{"r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9"}; !slices.Equal(got, want) {
		t.Fatalf("ids %v, want %v", got, want)
	}
}
