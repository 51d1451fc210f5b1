package ledger

import (
	"bytes"
	"encoding/binary"
	"math"
	"testing"
	"time"

	"github.com/cfguard/cfguard/certify"
)

// The decoders read bytes from a file that may be damaged: they must never panic, and whatever
// they accept must survive a round trip. Run one with
//
//	go test ./ledger -run '^$' -fuzz '^FuzzDecodeHeader$' -fuzztime 60s -fuzzminimizetime 5s

func FuzzDecodeHeader(f *testing.F) {
	h := header{status: certify.AtRisk, confirmed: true, cv: 7, target: 1, anchor: 3, p1: 0.97, var1: 0.003,
		delta: 0.05, epsilon: 0.01, samples: 1000, updated: 1e18}
	f.Add(h.encode())
	h.confirmed, h.cv, h.status = false, 0, certify.Certified
	f.Add(h.encode())
	f.Add(h.encode()[:header1Size])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, v []byte) {
		h, err := decodeHeader(v)
		if err != nil {
			return
		}
		back, err := decodeHeader(h.encode())
		if err != nil || back != h {
			t.Fatalf("round trip: %+v -> %+v, %v", h, back, err)
		}
		if v[0] == headerFormat && !bytes.Equal(h.encode(), v) {
			t.Fatalf("round trip of %x gives %x", v, h.encode())
		}
	})
}

func FuzzDecodeBody(f *testing.F) {
	p2 := 0.4
	b := body{created: 5, x: []float64{1, 2}, xcf: []float64{3, math.Inf(1)}, history: []StatusChange{
		{At: time.Unix(0, 9).UTC(), From: certify.Certified, To: certify.AtRisk, PosteriorVersion: 2, KL: 0.1, Bound: 0.4, VarBound: 0.2, P2: &p2},
		{At: time.Unix(0, 10).UTC(), From: certify.AtRisk, To: certify.Certified, PosteriorVersion: 3}}}
	f.Add(b.encode())
	f.Add((&body{}).encode())
	f.Add([]byte{bodyFormat, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, v []byte) {
		_, errNoHist := decodeBody(v, false)
		b, err := decodeBody(v, true)
		if err != nil {
			if errNoHist == nil && !bytes.Contains([]byte(err.Error()), []byte("history entry")) {
				t.Fatalf("accepted without history, refused with: %v", err)
			}
			return
		}
		if !bytes.Equal(b.encode(), v) {
			t.Fatalf("round trip of %x gives %x", v, b.encode())
		}
	})
}

func FuzzDecodeAnchor(f *testing.F) {
	f.Add(anchorMeta{refs: 3, kl: 1e-4, klVersion: 9, created: 1e18}.encode())
	f.Add(make([]byte, 32))
	f.Fuzz(func(t *testing.T, v []byte) {
		a, err := decodeAnchor(v)
		if err != nil {
			return
		}
		if !bytes.Equal(a.encode(), v) {
			t.Fatalf("round trip of %x gives %x", v, a.encode())
		}
	})
}

func FuzzDecodeKLEntry(f *testing.F) {
	e := KLEntry{At: time.Unix(0, 12345).UTC(), PosteriorVersion: 4, KL: 0.01, MaxAnchorKL: 0.02, Outcome: certify.OutcomeClipped}
	f.Add(u64bytes(1), e.encode())
	f.Add(u64bytes(2), []byte{})
	f.Fuzz(func(t *testing.T, k, v []byte) {
		e, err := decodeKLEntry(k, v)
		if err != nil {
			return
		}
		if !bytes.Equal(e.encode(), v) || e.Seq != binary.BigEndian.Uint64(k) {
			t.Fatalf("round trip of %x gives %x", v, e.encode())
		}
	})
}

func FuzzDecodeOutboxEntry(f *testing.F) {
	e := OutboxEntry{Key: "ce-1", Value: []byte(`{"to":"at_risk"}`)}
	f.Add(u64bytes(3), e.encode())
	f.Add(u64bytes(4), []byte{0x80})
	f.Fuzz(func(t *testing.T, k, v []byte) {
		e, err := decodeOutboxEntry(k, v)
		if err != nil {
			return
		}
		if !bytes.Equal(e.encode(), v) {
			t.Fatalf("round trip of %x gives %x", v, e.encode())
		}
	})
}

// FuzzDecodeModel fuzzes the stored posterior blob (bnn's sidecar JSON and safetensors inside).
func FuzzDecodeModel(f *testing.F) {
	blob, err := encodeModel(testModel(4))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(blob)
	f.Add(blob[:len(blob)/2])
	f.Add(modelMagic)
	f.Fuzz(func(t *testing.T, v []byte) {
		m, err := decodeModel(v)
		if err != nil {
			return
		}
		enc, err := encodeModel(m)
		if err != nil {
			t.Fatalf("a decoded posterior does not encode: %v", err)
		}
		back, err := decodeModel(enc)
		if err != nil {
			t.Fatal(err)
		}
		if enc2, _ := encodeModel(back); !bytes.Equal(enc, enc2) {
			t.Fatal("encode(decode(encode(m))) differs from encode(m)")
		}
	})
}
