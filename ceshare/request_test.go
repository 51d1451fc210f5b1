package ceshare

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

func TestRequestRoundTrip(t *testing.T) {
	at := time.Date(2026, 3, 1, 12, 0, 0, 123456789, time.UTC)
	for _, r := range []Request{
		{Kind: KindRegister, ID: "ce-1", CE: json.RawMessage(`{"x":[1,2.5],"p1":0.97}`), Replica: "r1", At: at},
		{Kind: KindDelete, ID: "a.b:c_d-9", Replica: "replica-2", At: at},
		{Kind: KindRegister, ID: "ce-2", CE: json.RawMessage(`{"x":[1]}`), Replica: "r1", At: at, RID: "key-0a1b", Fingerprint: "9f86d0"},
		{Kind: KindDelete, ID: "ce-2", Replica: "r1", At: at, RID: "QF3ZJ7XK2M"},
		{Kind: KindDelete, ID: "ce-3", Replica: "r1", At: at, IfMatch: []string{"0a1b", "*"}},
	} {
		key, value, err := Encode(r)
		if err != nil {
			t.Fatalf("Encode(%+v): %v", r, err)
		}
		if string(key) != r.ID {
			t.Errorf("key %q, want the id %q", key, r.ID)
		}
		got, err := Decode(key, value)
		if err != nil {
			t.Fatalf("Decode(%s): %v", value, err)
		}
		if !reflect.DeepEqual(got, r) {
			t.Errorf("round trip: got %+v, want %+v", got, r)
		}
	}
}

func TestDecodeRefusesMalformed(t *testing.T) {
	const at = `"2026-03-01T12:00:00Z"`
	for _, tc := range []struct{ name, key, value, reason string }{
		{"not json", "ce-1", `{"kind":`, ReasonJSON},
		{"not an object", "ce-1", `[1,2]`, ReasonJSON},
		{"unknown field", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"extra":1}`, ReasonJSON},
		{"trailing data", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `} {}`, ReasonJSON},
		{"unknown kind", "ce-1", `{"kind":"renew","id":"ce-1","replica":"r","at":` + at + `}`, ReasonKind},
		{"no kind", "ce-1", `{"id":"ce-1","replica":"r","at":` + at + `}`, ReasonKind},
		{"bad id", "a/b", `{"kind":"delete","id":"a/b","replica":"r","at":` + at + `}`, ReasonID},
		{"dot id", ".", `{"kind":"delete","id":".","replica":"r","at":` + at + `}`, ReasonID},
		{"key is not the id", "ce-2", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `}`, ReasonKey},
		{"no key", "", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `}`, ReasonKey},
		{"register without ce", "ce-1", `{"kind":"register","id":"ce-1","replica":"r","at":` + at + `}`, ReasonCE},
		{"register with a non-object ce", "ce-1", `{"kind":"register","id":"ce-1","ce":[1],"replica":"r","at":` + at + `}`, ReasonCE},
		{"delete with a ce", "ce-1", `{"kind":"delete","id":"ce-1","ce":{"x":1},"replica":"r","at":` + at + `}`, ReasonCE},
		{"no replica", "ce-1", `{"kind":"delete","id":"ce-1","at":` + at + `}`, ReasonReplica},
		{"no time", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r"}`, ReasonAt},
		{"rid with a space", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"rid":"a b"}`, ReasonRID},
		{"rid too long", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"rid":"` + strings.Repeat("r", MaxRIDLen+1) + `"}`, ReasonRID},
		{"fingerprint not ascii", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"fingerprint":"é"}`, ReasonRID},
		{"register with if_match", "ce-1", `{"kind":"register","id":"ce-1","ce":{},"replica":"r","at":` + at + `,"if_match":["0a"]}`, ReasonIfMatch},
		{"empty tag", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"if_match":[""]}`, ReasonIfMatch},
		{"tag with a space", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"if_match":["a b"]}`, ReasonIfMatch},
		{"tag too long", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"if_match":["` + strings.Repeat("t", MaxRIDLen+1) + `"]}`, ReasonIfMatch},
		{"too many tags", "ce-1", `{"kind":"delete","id":"ce-1","replica":"r","at":` + at + `,"if_match":["t"` + strings.Repeat(`,"t"`, MaxIfMatch) + `]}`, ReasonIfMatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Decode([]byte(tc.key), []byte(tc.value))
			var de *DecodeError
			if !errors.As(err, &de) || !errors.Is(err, ErrDecode) {
				t.Fatalf("Decode(%s): %v, want a *DecodeError", tc.value, err)
			}
			if de.Reason != tc.reason {
				t.Errorf("reason %q (%v), want %q", de.Reason, err, tc.reason)
			}
			if errors.Is(err, ErrNoOwner) || errors.Is(err, context.Canceled) {
				t.Errorf("Decode's error %v matches another package error than ErrDecode", err)
			}
			if n := strings.Count(" "+strings.Join(Reasons(), " ")+" ", " "+de.Reason+" "); n != 1 {
				t.Errorf("reason %q is %d times in Reasons() %q, want once (a counter starts at 0 for each)", de.Reason, n, Reasons())
			}
		})
	}
	// The reasons the member gives records it leaves out are counted from 0 too.
	for _, r := range []string{ReasonPartition, ReasonUnauthenticated} {
		if !slices.Contains(Reasons(), r) {
			t.Errorf("Reasons() %q lacks %q", Reasons(), r)
		}
	}
	if _, _, err := Encode(Request{Kind: KindRegister, ID: "ce-1", Replica: "r", At: time.Now()}); !errors.Is(err, ErrDecode) {
		t.Errorf("Encode of a registration without a CE: %v, want a refusal", err)
	}
}

// TestDecodeAcceptsTheEdgesOfItsRules: what Decode and Encode accept at the edge of each rule is
// a request: a RID or a fingerprint of MaxRIDLen bytes, made of the ends of printable ASCII ('!'
// and '~'), and a deletion whose CE is JSON null (a RawMessage holding null encodes as
// "ce":null; it carries no CE).
func TestDecodeAcceptsTheEdgesOfItsRules(t *testing.T) {
	at := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	edge := strings.Repeat("!~", MaxRIDLen/2) + strings.Repeat("~", MaxRIDLen%2)
	for _, tc := range []struct {
		name string
		r    Request
	}{
		{"rid of MaxRIDLen bytes", Request{Kind: KindDelete, ID: "ce-1", Replica: "r", At: at, RID: edge}},
		{"fingerprint of MaxRIDLen bytes", Request{Kind: KindRegister, ID: "ce-1", CE: json.RawMessage(`{}`), Replica: "r", At: at, Fingerprint: edge}},
		{"rid of the first printable byte", Request{Kind: KindDelete, ID: "ce-1", Replica: "r", At: at, RID: "!"}},
		{"rid of the last printable byte", Request{Kind: KindDelete, ID: "ce-1", Replica: "r", At: at, RID: "~"}},
		{"deletion with a null CE", Request{Kind: KindDelete, ID: "ce-1", CE: json.RawMessage(`null`), Replica: "r", At: at}},
		{"deletion naming MaxIfMatch tags of MaxRIDLen bytes", Request{Kind: KindDelete, ID: "ce-1", Replica: "r", At: at, IfMatch: slices.Repeat([]string{edge}, MaxIfMatch)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if len(tc.r.RID) > MaxRIDLen || len(tc.r.Fingerprint) > MaxRIDLen {
				t.Fatalf("the case is past MaxRIDLen %d", MaxRIDLen)
			}
			key, value, err := Encode(tc.r)
			if err != nil {
				t.Fatalf("Encode(%+v): %v", tc.r, err)
			}
			got, err := Decode(key, value)
			if err != nil {
				t.Fatalf("Decode(%s): %v", value, err)
			}
			if !reflect.DeepEqual(got, tc.r) {
				t.Errorf("round trip: got %+v, want %+v", got, tc.r)
			}
		})
	}
}

// TestPartitionMatchesKafkaGo holds Partition to kafka-go's Murmur2Balancer (which follows
// Kafka's Java partitioner) over ids of every length class of murmur2's tail.
func TestPartitionMatchesKafkaGo(t *testing.T) {
	bal := kafka.Murmur2Balancer{Consistent: true}
	for _, n := range []int{1, 3, 12, 32, 100} {
		parts := make([]int, n)
		for i := range parts {
			parts[i] = i
		}
		for i := range 400 {
			id := fmt.Sprintf("ce-%d-%s", i, strings.Repeat("x", i%7))
			want := bal.Balance(kafka.Message{Key: []byte(id)}, parts...)
			if got := Partition(id, n); got != want {
				t.Fatalf("Partition(%q, %d) = %d, kafka-go's Murmur2Balancer says %d", id, n, got, want)
			}
		}
	}
	// A value from Kafka's own tests (UtilsTest.testMurmur2): "21" hashes to -973932308.
	if got := int32(murmur2([]byte("21"))); got != -973932308 {
		t.Errorf("murmur2(%q) = %d, Kafka's test says -973932308", "21", got)
	}
}
