package daemon

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/cfguard/cfguard/bnn"
)

// smallModel is a small untrained model of three features and two classes at version v.
func smallModel(v uint64) *bnn.Model {
	m := bnn.New(3, []int{6}, []string{"no", "yes"}, 0.1, rand.New(rand.NewPCG(7, 8)))
	m.Version = v
	return m
}

// The shared pool is drawn once per posterior version: asking again for the cached version draws
// nothing, a newer version's pool replaces it, and an older version's pool is drawn without
// replacing the newer one and kept until another older version is asked for. The same version always draws the same networks, in
// another pool cache too (a restart measures as before).
func TestPoolsDrawOncePerVersionAndKeepTheNewest(t *testing.T) {
	ps := &pools{samples: 8, prec: bnn.Float64}
	v5, v6, v4 := smallModel(5), smallModel(6), smallModel(4)
	get := func(m *bnn.Model) *bnn.Pool {
		t.Helper()
		p, err := ps.get(m)
		if err != nil {
			t.Fatal(err)
		}
		if p.Version() != m.Version {
			t.Fatalf("the pool of version %d for version %d", p.Version(), m.Version)
		}
		return p
	}
	p5 := get(v5)
	for _, s := range []struct {
		name  string
		m     *bnn.Model
		same  *bnn.Pool // the pool expected, if the cached one
		drawn int
	}{
		{"the cached version", v5, p5, 1},
		{"an older version", v4, nil, 2},
		{"the cached version after an older one", v5, p5, 2},
		{"a newer version", v6, nil, 3},
		{"the older version again", v4, nil, 3},
	} {
		p := get(s.m)
		if s.same != nil && p != s.same {
			t.Fatalf("%s: a new pool, want the cached one", s.name)
		}
		if s.same == nil && p == p5 {
			t.Fatalf("%s: the cached pool of version 5", s.name)
		}
		if ps.drawn != s.drawn {
			t.Fatalf("%s: %d pools drawn, want %d", s.name, ps.drawn, s.drawn)
		}
	}
	if p := get(v6); ps.drawn != 3 || p.Version() != 6 {
		t.Fatalf("version 6 again: %d pools drawn, want 3 (it is cached)", ps.drawn)
	}
	if _, err := ps.get(v5); err != nil || ps.drawn != 4 {
		t.Fatalf("version 5 after version 6: %d pools drawn (%v), want 4 (the newer one is kept)", ps.drawn, err)
	}
	if get(v5); ps.drawn != 4 {
		t.Fatalf("version 5 again: %d pools drawn, want 4 (the last older one is kept)", ps.drawn)
	}
	if get(v4); ps.drawn != 5 {
		t.Fatalf("version 4 after version 5: %d pools drawn, want 5 (one older pool is kept)", ps.drawn)
	}

	xs := [][]float64{{0.1, -0.2, 0.3}, {1, 2, 3}}
	a, err := get(v6).Predict(context.Background(), xs)
	if err != nil {
		t.Fatal(err)
	}
	again, err := (&pools{samples: 8, prec: bnn.Float64}).get(v6)
	if err != nil {
		t.Fatal(err)
	}
	b, err := again.Predict(context.Background(), xs)
	if err != nil {
		t.Fatal(err)
	}
	if !sameSums(a.Mean, b.Mean) || !sameSums(a.Var, b.Var) {
		t.Fatalf("two draws of version 6 differ: %v, %v", a.Mean, b.Mean)
	}
}

// A pool that cannot be drawn is the caller's error and is not counted as drawn; a prediction
// whose request has ended draws no pool and answers the request's error.
func TestPredictNowRefusals(t *testing.T) {
	d := &Daemon{pools: &pools{samples: 1, prec: bnn.Float64}}
	xs := [][]float64{{0.1, -0.2, 0.3}}
	if _, err := d.predictNow(context.Background(), smallModel(1), xs); err == nil || d.pools.drawn != 0 {
		t.Fatalf("a pool of 1 draw: %v, %d drawn; want an error and none drawn", err, d.pools.drawn)
	}
	d.pools.samples = 8
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.predictNow(ctx, smallModel(1), xs); !errors.Is(err, context.Canceled) || d.pools.drawn != 0 {
		t.Fatalf("an ended request: %v, %d pools drawn; want context.Canceled and none drawn", err, d.pools.drawn)
	}
	p, err := d.predictNow(context.Background(), smallModel(1), xs)
	if err != nil || p.N != 1 || p.S != 8 || d.pools.drawn != 1 {
		t.Fatalf("a prediction: %+v, %v, %d pools drawn", p, err, d.pools.drawn)
	}
}

// The posterior's files are those bnn.Encode writes for the version asked for, with the SHA-256
// of the weights and each file's ETag its quoted SHA-256; a version's files are encoded once and
// a newer version's replace them.
func TestPosteriorFilesNameTheirVersion(t *testing.T) {
	var c posteriorCache
	sum := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	var firstOf5 *posteriorFiles
	for _, v := range []uint64{5, 5, 6} {
		m := smallModel(v)
		m.Last().BiasMu[1] = float64(v) // each version its own weights
		pf, err := c.get(m)
		if err != nil {
			t.Fatal(err)
		}
		sidecar, weights, err := bnn.Encode(m)
		if err != nil {
			t.Fatal(err)
		}
		if pf.version != v || !bytes.Equal(pf.sidecar, sidecar) || !bytes.Equal(pf.weights, weights) {
			t.Fatalf("version %d: the files of version %d, or not its encoding", v, pf.version)
		}
		if pf.weightsSHA256 != sum(weights) || pf.weightsETag != `"`+sum(weights)+`"` || pf.sidecarETag != `"`+sum(sidecar)+`"` {
			t.Fatalf("version %d: sha256 %s, ETags %s %s; want %s, %q, %q", v, pf.weightsSHA256, pf.weightsETag, pf.sidecarETag,
				sum(weights), sum(weights), sum(sidecar))
		}
		switch {
		case firstOf5 == nil:
			firstOf5 = pf
		case v == 5 && pf != firstOf5:
			t.Fatal("version 5 was encoded again")
		}
	}
}
