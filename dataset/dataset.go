// Package dataset loads labelled tabular data: CSV with a header row, numeric feature columns and
// a last column "label" holding an integer class 0..C-1. It also does seeded shuffles and splits.
package dataset

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
)

// Set is a labelled data set: X[i] has len(Features) values, Y[i] in [0, NumClasses).
type Set struct {
	Features   []string
	X          [][]float64
	Y          []int
	NumClasses int
}

// MaxClasses bounds a label: the model gets one output per class 0..max(label), so a label past
// it is a typo, not a class (a label of 2e9 would ask for 2e9 outputs).
const MaxClasses = 1000

// ErrFormat is wrapped by every parse error.
var ErrFormat = errors.New("bad data file")

// LoadCSV reads a CSV file; see Parse.
func LoadCSV(path string) (*Set, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	s, err := Parse(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// Parse reads CSV from r. Every row must have as many fields as the header, every feature must
// parse as a finite number, and every label as an integer in [0, MaxClasses); feature names,
// without the blanks around them, must be non-empty and distinct. Errors name the line and
// column. NumClasses is max(label) + 1; a data set with a single class is refused.
func Parse(r io.Reader) (*Set, error) {
	cr := csv.NewReader(r)
	cr.ReuseRecord = true
	rec, err := cr.Read()
	header := append([]string(nil), rec...) // ReuseRecord: later reads overwrite rec
	if err != nil {
		return nil, fmt.Errorf("%w: reading header: %v", ErrFormat, err)
	}
	if len(header) < 2 {
		return nil, fmt.Errorf("%w: header has %d columns, need features and a label", ErrFormat, len(header))
	}
	if strings.TrimSpace(header[len(header)-1]) != "label" {
		return nil, fmt.Errorf("%w: last column is %q, want \"label\"", ErrFormat, header[len(header)-1])
	}
	d := len(header) - 1
	s := &Set{Features: make([]string, d)}
	seen := make(map[string]int, d)
	for j := range s.Features {
		f := strings.TrimSpace(header[j]) // as numbers and the label column are
		s.Features[j] = f
		if f == "" {
			return nil, fmt.Errorf("%w: header column %d has no name", ErrFormat, j+1)
		}
		if k, ok := seen[f]; ok {
			return nil, fmt.Errorf("%w: header columns %d and %d are both named %q", ErrFormat, k+1, j+1, f)
		}
		seen[f] = j
	}
	for line := 2; ; line++ {
		rec, err := cr.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: line %d: %v", ErrFormat, line, err)
		}
		x := make([]float64, d)
		for j := 0; j < d; j++ {
			v, err := strconv.ParseFloat(strings.TrimSpace(rec[j]), 64)
			if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
				return nil, fmt.Errorf("%w: line %d column %q: %q is not a finite number", ErrFormat, line, header[j], rec[j])
			}
			x[j] = v
		}
		y, err := strconv.Atoi(strings.TrimSpace(rec[d]))
		if err != nil || y < 0 {
			return nil, fmt.Errorf("%w: line %d: label %q is not a class index 0..C-1", ErrFormat, line, rec[d])
		}
		if y >= MaxClasses {
			return nil, fmt.Errorf("%w: line %d: label %d is past the %d classes a data set may have (labels 0..%d)", ErrFormat, line, y, MaxClasses, MaxClasses-1)
		}
		s.X = append(s.X, x)
		s.Y = append(s.Y, y)
		s.NumClasses = max(s.NumClasses, y+1)
	}
	if len(s.X) == 0 {
		return nil, fmt.Errorf("%w: no data rows", ErrFormat)
	}
	if s.NumClasses < 2 {
		return nil, fmt.Errorf("%w: only one class present", ErrFormat)
	}
	return s, nil
}

// Len is the number of rows.
func (s *Set) Len() int { return len(s.X) }

// Subset returns the rows at idx (sharing the feature slices).
func (s *Set) Subset(idx []int) *Set {
	o := &Set{Features: s.Features, NumClasses: s.NumClasses, X: make([][]float64, len(idx)), Y: make([]int, len(idx))}
	for k, i := range idx {
		o.X[k], o.Y[k] = s.X[i], s.Y[i]
	}
	return o
}

// Permutation returns a seeded random permutation of the row indices.
func (s *Set) Permutation(seed uint64) []int {
	rng := rand.New(rand.NewPCG(seed, 0xda7a5e7))
	return rng.Perm(len(s.X))
}

// Split shuffles with seed and returns (train, test) with round(frac*n) rows in train.
func (s *Set) Split(frac float64, seed uint64) (train, test *Set) {
	p := s.Permutation(seed)
	k := int(math.Round(frac * float64(len(p))))
	return s.Subset(p[:k]), s.Subset(p[k:])
}
