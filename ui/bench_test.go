package ui_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/cfguard/cfguard/bnn"
	"github.com/cfguard/cfguard/certify"
	"github.com/cfguard/cfguard/ledger"
	"github.com/cfguard/cfguard/ui"
)

// ledgerSource is the pages' Source over a ledger alone, as the daemon's reads it.
type ledgerSource struct{ l *ledger.Ledger }

func (s ledgerSource) Snapshot(context.Context) (ui.Snapshot, error) {
	m, err := s.l.Current()
	if err != nil {
		return ui.Snapshot{}, err
	}
	st, err := s.l.State()
	if err != nil {
		return ui.Snapshot{}, err
	}
	h, err := s.l.KLHistory(100)
	if err != nil {
		return ui.Snapshot{}, err
	}
	return ui.Snapshot{PosteriorVersion: m.Version, Features: m.Features, Classes: m.Classes, Budget: certify.KLBudget(0.05),
		Delta: 0.05, Epsilon: 0.01, Alpha: certify.DefaultVerdictAlpha, Mode: "paper", State: st, History: h, Now: time.Now()}, nil
}

func (s ledgerSource) List(_ context.Context, st certify.Status, limit int, after string) ([]*ledger.CE, string, error) {
	ces, err := s.l.List(st, limit, after)
	next := ""
	if err == nil && len(ces) == limit {
		next = ces[len(ces)-1].ID
	}
	return ces, next, err
}
func (s ledgerSource) Get(_ context.Context, id string) (*ledger.CE, error) { return s.l.Get(id) }
func (s ledgerSource) Events(n int) ([]ledger.OutboxEntry, error)           { return s.l.OutboxNewest(n) }
func (s ledgerSource) Publishing() ui.Publishing                            { return ui.Publishing{} }

var (
	fixtureMu sync.Mutex
	fixtures  = map[int]*ledger.Ledger{}
)

// benchLedger stores n CEs of 30 features over two posterior versions, built once per binary.
func benchLedger(b *testing.B, n int) *ledger.Ledger {
	fixtureMu.Lock()
	defer fixtureMu.Unlock()
	if l := fixtures[n]; l != nil {
		return l
	}
	l, err := ledger.Open(b.TempDir(), ledger.Options{Policy: certify.DefaultPolicy(), Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(7, 1))
	m := bnn.New(30, bnn.DefaultHidden, []string{"malignant", "benign"}, 0.1, rng)
	if err := l.Checkpoint(&ledger.Checkpoint{Model: m}); err != nil {
		b.Fatal(err)
	}
	const batch = 20_000
	for lo := 0; lo < n; lo += batch {
		ces := make([]*ledger.CE, 0, batch)
		for i := lo; i < min(lo+batch, n); i++ {
			x, xcf := make([]float64, 30), make([]float64, 30)
			for j := range x {
				x[j], xcf[j] = rng.NormFloat64(), rng.NormFloat64()
			}
			ces = append(ces, &ledger.CE{ID: fmt.Sprintf("ce-%08d", i), X: x, XCF: xcf, Target: 1, AnchorVersion: m.Version,
				P1: 0.96 + 0.039*rng.Float64(), Var1: 0.005 * rng.Float64(), Samples: 1000, Delta: 0.05, Epsilon: 0.01})
		}
		if err := l.Put(context.Background(), ces...); err != nil {
			b.Fatal(err)
		}
	}
	fixtures[n] = l
	return l
}

// BenchmarkPages times the server's work for each page (the handler writing the whole page to
// a recorder) against a 10^4 and a 10^5 CE ledger, and beside them the ledger reads a list page
// needs (one List of the page's size), the reference its ratio is quoted against:
//
//	go test ./ui -run '^$' -bench Pages -benchtime 200x -count 3
func BenchmarkPages(b *testing.B) {
	for _, n := range []int{10_000, 100_000} {
		b.Run(fmt.Sprintf("n=%d", n), func(b *testing.B) {
			l := benchLedger(b, n)
			u := ui.New(ui.Config{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, ledgerSource{l})
			mid := fmt.Sprintf("ce-%08d", n/2)
			for _, p := range []struct{ name, path string }{
				{"overview", "/ui/"},
				{"list", "/ui/counterfactuals"},
				{"list-after", "/ui/counterfactuals?after=" + mid},
				{"list-undecided", "/ui/counterfactuals?decided=no"},
				{"ce", "/ui/counterfactuals/" + mid},
				{"certificate", "/ui/counterfactuals/" + mid + "/certificate"},
				{"events", "/ui/events"},
			} {
				b.Run(p.name, func(b *testing.B) {
					for b.Loop() {
						rec := httptest.NewRecorder()
						u.ServeHTTP(rec, httptest.NewRequest("GET", p.path, nil))
						if rec.Code != 200 {
							b.Fatalf("%s: %d %s", p.path, rec.Code, rec.Body)
						}
					}
				})
			}
			b.Run("ledger-list", func(b *testing.B) {
				for b.Loop() {
					if ces, err := l.List(0, 50, mid); err != nil || len(ces) != 50 {
						b.Fatalf("List: %d, %v", len(ces), err)
					}
				}
			})
		})
	}
}
