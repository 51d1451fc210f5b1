package bnn

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"unsafe"

	G "gorgonia.org/gorgonia"
)

// A read node whose hash equals another node's is given another place before the graph is
// compiled, where gorgonia would compile the two as one node (see Compile). The test finds a place
// whose read node's hash equals that of another node of the Bayes-by-backprop objective: it
// computes gorgonia's hash of a read node (FNV-1a over its type and shape, "print <address>", its
// one child and the child's hash, checked against the hash gorgonia gives one) for each place of
// an arena. It builds the graph with that place for that read and checks that Compile moved the
// read and that the graph computes, bit for bit, what one built with ordinary places does.
func TestCompileMovesAReadWhoseHashIsTaken(t *testing.T) {
	m := New(30, []int{16, 16}, []string{"a", "b"}, DefaultPriorSigma, rand.New(rand.NewPCG(1, 2)))
	cfg := GraphConfig{Batch: 8, Samples: 4}
	rng := rand.New(rand.NewPCG(3, 4))
	rows, labels := make([][]float64, 8), make([]int, 8)
	for i := range rows {
		rows[i], labels[i] = make([]float64, 30), i%2
		for j := range rows[i] {
			rows[i][j] = rng.NormFloat64()
		}
	}
	run := func(b *GraphBuilder) (Eval, [][]float64) {
		t.Helper()
		gr, err := newGraph(m, cfg, b)
		if err != nil {
			t.Fatal(err)
		}
		if err := gr.SetBatch(rows, labels); err != nil {
			t.Fatal(err)
		}
		gr.SetEps(func(s, k int, bias bool, i int) float64 { return float64((s+3*k+i)%7)/3 - 1 })
		ev, err := gr.Run()
		if err != nil {
			t.Fatal(err)
		}
		var grads [][]float64
		for _, p := range gr.Params() {
			grads = append(grads, append([]float64(nil), p.Grad...))
		}
		return ev, grads
	}
	want, wantGrads := run(NewGraphBuilder("graph"))

	// The hashes of the graph's other nodes, and each read node's hash as a function of its place.
	probe := NewGraphBuilder("graph")
	if _, err := newGraph(m, cfg, probe); err != nil {
		t.Fatal(err)
	}
	reads := map[*G.Node]bool{}
	for _, r := range probe.reads {
		reads[r.node] = true
	}
	taken := map[uint32]bool{}
	for _, n := range probe.g.AllNodes() {
		if !reads[n] {
			taken[n.Hashcode()] = true
		}
	}
	hashAt := make([]func(addr uintptr) uint32, len(probe.reads))
	for i, r := range probe.reads {
		prefix := fnv32a(fnvOffset, []byte(fmt.Sprintf("%v%v", r.node.Type(), r.node.Shape())+"print "))
		var suffix [5]byte
		suffix[0] = 1 // one child
		binary.LittleEndian.PutUint32(suffix[1:], r.src.Hashcode())
		hashAt[i] = func(addr uintptr) uint32 {
			var buf [24]byte
			return fnv32a(fnv32a(prefix, strconv.AppendUint(append(buf[:0], "0x"...), uint64(addr), 16)), suffix[:])
		}
		if got := hashAt[i](uintptr(unsafe.Pointer(r.box))); got != r.node.Hashcode() {
			t.Fatalf("read %d: hash %08x computed, gorgonia's %08x: the test does not hash as gorgonia does", i, got, r.node.Hashcode())
		}
	}
	var arenas [][]G.Value
	clash, slot := -1, -1
	for len(arenas) < 16 && clash < 0 {
		arena := make([]G.Value, 1<<20)
		arenas = append(arenas, arena)
		for k := range arena {
			addr := uintptr(unsafe.Pointer(&arena[k]))
			for i := range hashAt {
				if taken[hashAt[i](addr)] {
					clash, slot = i, k
					break
				}
			}
			if clash >= 0 {
				break
			}
		}
	}
	if clash < 0 {
		t.Fatalf("no place in %d arenas of %d whose read node's hash another node has", len(arenas), 1<<20)
	}
	place := &arenas[len(arenas)-1][slot]

	b := NewGraphBuilder("graph")
	b.box = func(i int) *G.Value {
		if i == clash && place != nil {
			p := place
			place = nil
			return p
		}
		return new(G.Value)
	}
	got, gotGrads := run(b)
	if place != nil {
		t.Fatal("the read was not placed where its hash is another node's")
	}
	if got != want || fmt.Sprint(gotGrads) != fmt.Sprint(wantGrads) {
		t.Fatalf("with read %d first placed where its hash is another node's: %+v, want %+v (or gradients differ)", clash, got, want)
	}
	t.Logf("read %d of %d first placed at slot %d of arena %d, where its hash is another node's; %d nodes", clash, len(probe.reads), slot, len(arenas), len(taken))
}

const fnvOffset uint32 = 2166136261

// fnv32a goes on with FNV-1a hash h over p.
func fnv32a(h uint32, p []byte) uint32 {
	for _, c := range p {
		h ^= uint32(c)
		h *= 16777619
	}
	return h
}
