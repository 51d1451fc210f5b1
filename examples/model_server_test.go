package examples

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"testing"
	"time"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/examples/internal/modelserver"
	"github.com/cfguard/cfguard/internal/atomicfile"
	"github.com/cfguard/cfguard/internal/tooltest"
	"github.com/cfguard/cfguard/internal/waitfor"
)

type prediction struct {
	P                [][]float64 `json:"p"`
	Var              [][]float64 `json:"var"`
	Class            []string    `json:"class"`
	PosteriorVersion uint64      `json:"posterior_version"`
	Samples          int         `json:"samples"`
}

func predict(t *testing.T, url string, xs [][]float64) prediction {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"xs": xs})
	resp, err := http.Post(url+"/predict", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /predict: %s: %s", resp.Status, raw)
	}
	var p prediction
	if err := json.Unmarshal(raw, &p); err != nil {
		t.Fatal(err)
	}
	return p
}

type health struct {
	PosteriorVersion uint64 `json:"posterior_version"`
	Reloads          int    `json:"reloads"`
	ReloadsRefused   int    `json:"reloads_refused"`
}

func healthz(t *testing.T, url string) health {
	t.Helper()
	resp, err := http.Get(url + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h health
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatal(err)
	}
	return h
}

// goSamples is the number of draws of cfguard's predictive in the comparisons.
const goSamples = 20000

// cfguardPredictive is cfguard's predictive for xs with goSamples draws.
func cfguardPredictive(t *testing.T, m *bnn.Model, xs [][]float64) *bnn.Predictive {
	t.Helper()
	p, err := m.Predict(xs, goSamples, 99)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// compare checks the server's predictive against cfguard's for the same inputs: two independent
// Monte-Carlo means of one quantity, in float64 on both sides, so for every input and class
//
//	|p_server - p_cfguard| <= 4 sqrt(var_server / S_server + var_cfguard / S_cfguard) + 1e-9.
//
// It returns the largest |difference| / tolerance; with fail set, an input over tolerance fails
// the test.
func compare(t *testing.T, got prediction, want *bnn.Predictive, fail bool) float64 {
	t.Helper()
	worst := 0.0
	for i := range got.P {
		for c := range got.P[i] {
			diff := math.Abs(got.P[i][c] - want.P(i, c))
			tol := 4*math.Sqrt(got.Var[i][c]/float64(got.Samples)+want.V(i, c)/float64(want.S)) + 1e-9
			worst = math.Max(worst, diff/tol)
			if fail && diff > tol {
				t.Errorf("input %d class %d: server p %.5f, cfguard p %.5f: |diff| %.3g > tolerance %.3g", i, c, got.P[i][c], want.P(i, c), diff, tol)
			}
		}
	}
	return worst
}

// probeInputs returns points on the segment from a to b: both ends, and seven around where m's
// predictive of class 1 crosses 1/2 (bisection on a 200-draw predictive), so that several
// predictives are far from 0 and 1.
func probeInputs(t *testing.T, m *bnn.Model, a, b []float64) [][]float64 {
	t.Helper()
	at := func(lam float64) []float64 {
		x := make([]float64, len(a))
		for j := range x {
			x[j] = a[j] + lam*(b[j]-a[j])
		}
		return x
	}
	p1 := func(lam float64) float64 {
		p, err := m.Predict([][]float64{at(lam)}, 200, 1)
		if err != nil {
			t.Fatal(err)
		}
		return p.P(0, 1)
	}
	lo, hi := 0.0, 1.0
	for range 30 {
		mid := (lo + hi) / 2
		if (p1(mid) > 0.5) == (p1(lo) > 0.5) {
			lo = mid
		} else {
			hi = mid
		}
	}
	xs := [][]float64{at(0), at(1)}
	for _, d := range []float64{-0.03, -0.02, -0.01, 0, 0.01, 0.02, 0.03} {
		xs = append(xs, at(math.Min(1, math.Max(0, lo+d))))
	}
	return xs
}

// TestModelServerFollowsExports: the example model server serves a posterior written by
// bnn.Save with cfguard's predictive, refuses a sidecar whose weights have not arrived, and
// switches to each new posterior version within a few seconds of it being written.
func TestModelServerFollowsExports(t *testing.T) {
	py := tooltest.PythonTorch(t)
	set, ds, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	m7, _, err := bnn.Fit(context.Background(), set, ds.Classes, bnn.TrainConfig{Epochs: 5, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	m7.Version = 7
	dir := t.TempDir()
	if err := bnn.Save(dir, m7); err != nil {
		t.Fatal(err)
	}
	// Inputs on the segment from a class-0 row to a class-1 row, most near the decision boundary.
	var a, b []float64
	for i, y := range set.Y {
		if y == 0 && a == nil {
			a = set.X[i]
		}
		if y == 1 && b == nil {
			b = set.X[i]
		}
	}
	xs := probeInputs(t, m7, a, b)
	want7 := cfguardPredictive(t, m7, xs)

	const samples = 4000
	url, log := modelserver.Start(t, py, dir, samples)
	got := predict(t, url, xs)
	if got.PosteriorVersion != 7 || got.Samples != samples {
		t.Fatalf("version %d samples %d, want 7 and %d", got.PosteriorVersion, got.Samples, samples)
	}
	mid := 0
	for _, p := range got.P {
		if p[1] > 0.05 && p[1] < 0.95 {
			mid++
		}
	}
	if mid < 3 {
		t.Fatalf("only %d inputs have a predictive away from 0 and 1: the comparison has no power (%v)", mid, got.P)
	}
	t.Logf("version 7: largest |diff|/tolerance %.3f, %d of %d inputs with 0.05 < p < 0.95", compare(t, got, want7, true), mid, len(xs))

	// Version 8 changes the last layer: its class rows swapped, every prediction flips.
	m8 := m7.Clone()
	m8.Version = 8
	last := m8.Last()
	for i := 0; i < last.In; i++ {
		last.WeightMu[i], last.WeightMu[last.In+i] = last.WeightMu[last.In+i], last.WeightMu[i]
	}
	last.BiasMu[0], last.BiasMu[1] = last.BiasMu[1], last.BiasMu[0]
	sidecar8, weights8, err := bnn.Encode(m8)
	if err != nil {
		t.Fatal(err)
	}
	// The sidecar arrives before its weights (the opposite of bnn.Save's order): the pair on
	// disk is mixed, and the server must keep serving version 7.
	if err := atomicfile.WriteFile(dir+"/"+bnn.SidecarFile, sidecar8); err != nil {
		t.Fatal(err)
	}
	waitfor.Cond(t, 10*time.Second, "a refused reload of the mixed pair", func() bool { return healthz(t, url).ReloadsRefused >= 1 })
	got = predict(t, url, xs)
	if got.PosteriorVersion != 7 {
		t.Fatalf("serving version %d from a mixed pair, want 7", got.PosteriorVersion)
	}
	compare(t, got, want7, true)
	if err := atomicfile.WriteFile(dir+"/"+bnn.WeightsFile, weights8); err != nil {
		t.Fatal(err)
	}
	// The server looks every --poll (1 s) and then loads the pair with torch; the wait bounds
	// that on a busy machine, and the time it took is logged.
	took := waitfor.Cond(t, 30*time.Second, "version 8", func() bool { return healthz(t, url).PosteriorVersion == 8 })
	got = predict(t, url, xs)
	if got.PosteriorVersion != 8 {
		t.Fatalf("version %d, want 8", got.PosteriorVersion)
	}
	want8 := cfguardPredictive(t, m8, xs)
	t.Logf("version 8 served %v after its weights; largest |diff|/tolerance %.3f", took, compare(t, got, want8, true))
	if r := compare(t, got, want7, false); r <= 1 {
		t.Fatalf("version 8's predictions agree with version 7's (ratio %.3f): the check cannot see a reload", r)
	}

	// Version 9, written as the daemon will write it: bnn.Save.
	m9 := m7.Clone()
	m9.Version = 9
	for i := range m9.Last().BiasMu {
		m9.Last().BiasMu[i] += []float64{1.5, -1.5}[i]
	}
	if err := bnn.Save(dir, m9); err != nil {
		t.Fatal(err)
	}
	took = waitfor.Cond(t, 30*time.Second, "version 9", func() bool { return healthz(t, url).PosteriorVersion == 9 })
	got = predict(t, url, xs)
	t.Logf("version 9 served %v after bnn.Save; largest |diff|/tolerance %.3f", took, compare(t, got, cfguardPredictive(t, m9, xs), true))
	if r := compare(t, got, want8, false); r <= 1 {
		t.Fatalf("version 9's predictions agree with version 8's (ratio %.3f)", r)
	}
	if h := healthz(t, url); h.Reloads != 2 {
		t.Errorf("reloads %d, want 2 (8 and 9)", h.Reloads)
	}
	t.Logf("server log:\n%s", log.String())
}
