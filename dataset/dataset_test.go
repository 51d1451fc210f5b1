package dataset

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	s, err := Parse(strings.NewReader("a,b c,label\n1,2.5,0\n-3,4e2,2\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s.Len() != 2 || s.NumClasses != 3 || s.Features[1] != "b c" || s.X[1][1] != 400 || s.Y[1] != 2 {
		t.Fatalf("parsed %+v", s)
	}
	if s, err := Parse(strings.NewReader(fmt.Sprintf("a,label\n1,0\n2,%d\n", MaxClasses-1))); err != nil || s.NumClasses != MaxClasses {
		t.Fatalf("the largest label: %v, %+v", err, s)
	}
}

func TestParseErrorsNameLineAndColumn(t *testing.T) {
	cases := map[string]struct{ text, want string }{
		"empty":        {"", "header"},
		"no label":     {"a,b\n1,2\n", `want "label"`},
		"one column":   {"label\n1\n", "columns"},
		"short row":    {"a,b,label\n1,2,0\n1,1\n", "line 3"},
		"nan":          {"a,b,label\n1,2,0\n1,NaN,1\n", `line 3 column "b"`},
		"inf":          {"a,b,label\n1,+Inf,0\n", `column "b"`},
		"text":         {"a,b,label\nx,1,0\n", `column "a"`},
		"label float":  {"a,label\n1,0.5\n", "label"},
		"label neg":    {"a,label\n1,-1\n", "label"},
		"no rows":      {"a,label\n", "no data rows"},
		"single class": {"a,label\n1,0\n2,0\n", "one class"},
		"huge label":   {"a,label\n1,0\n2,2000000000\n", "line 3: label 2000000000 is past the 1000 classes"},
		"label at max": {"a,label\n1,0\n2,1000\n", "line 3: label 1000"},
		"no name":      {"a,,label\n1,2,0\n", "header column 2 has no name"},
		"blank name":   {" ,b,label\n1,2,0\n", "header column 1 has no name"},
		"same names":   {"a,b,a,label\n1,2,3,0\n", `header columns 1 and 3 are both named "a"`},
		"same trimmed": {"a, a,label\n1,2,0\n", `header columns 1 and 2 are both named "a"`},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Parse(strings.NewReader(tc.text))
			if err == nil || !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrFormat mentioning %q", err, tc.want)
			}
		})
	}
}

func TestSplitIsSeededPartition(t *testing.T) {
	var b strings.Builder
	b.WriteString("a,label\n")
	for i := 0; i < 100; i++ {
		b.WriteString(strings.Repeat("1", 1) + "," + []string{"0", "1"}[i%2] + "\n")
	}
	s, _ := Parse(strings.NewReader(b.String()))
	tr, te := s.Split(0.8, 3)
	tr2, _ := s.Split(0.8, 3)
	if tr.Len() != 80 || te.Len() != 20 {
		t.Fatalf("split %d/%d", tr.Len(), te.Len())
	}
	p1, p2 := s.Permutation(3), s.Permutation(4)
	same := true
	for i := range p1 {
		same = same && p1[i] == p2[i]
	}
	if same {
		t.Fatal("different seeds gave the same permutation")
	}
	for i := range tr.Y {
		if tr.Y[i] != tr2.Y[i] {
			t.Fatal("same seed gave a different split")
		}
	}
}

// TestParseTrimsBlanks: blanks around a number, a label or the header's "label" are not part of
// them (a CSV written with ", " separators loads).
func TestParseTrimsBlanks(t *testing.T) {
	s, err := Parse(strings.NewReader("a, b ,label \n 1.5 , 3, 0 \n-2,4,\t1\n"))
	if err != nil {
		t.Fatal(err)
	}
	if s.Len() != 2 || s.X[0][0] != 1.5 || s.X[1][0] != -2 || s.Y[0] != 0 || s.Y[1] != 1 || s.NumClasses != 2 {
		t.Fatalf("parsed %+v", s)
	}
	if !slices.Equal(s.Features, []string{"a", "b"}) {
		t.Fatalf("features %q, want [a b]", s.Features)
	}
}

// rowsSet is a data set of n rows whose row i is feature i and label i%2, so that a row can be
// recognised and its label checked in any subset.
func rowsSet(t *testing.T, n int) *Set {
	t.Helper()
	var b strings.Builder
	b.WriteString("x,label\n")
	for i := range n {
		fmt.Fprintf(&b, "%d,%d\n", i, i%2)
	}
	s, err := Parse(strings.NewReader(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSplitPartitionsRows: Split puts every row in exactly one of train and test, with its own
// label, keeps the features and the number of classes, and gives train round(frac*n) rows,
// half away from zero: 2.5 -> 3, 1.5 -> 2, 0.4 -> 0.
func TestSplitPartitionsRows(t *testing.T) {
	for _, tc := range []struct {
		n           int
		frac        float64
		train, test int
	}{{5, 0.5, 3, 2}, {3, 0.5, 2, 1}, {2, 0.2, 0, 2}, {4, 1, 4, 0}} {
		s := rowsSet(t, tc.n)
		tr, te := s.Split(tc.frac, 9)
		if tr.Len() != tc.train || te.Len() != tc.test {
			t.Errorf("%d rows, frac %v: split %d/%d, want %d/%d", tc.n, tc.frac, tr.Len(), te.Len(), tc.train, tc.test)
			continue
		}
		seen := make([]int, tc.n)
		for _, part := range []*Set{tr, te} {
			if part.NumClasses != 2 || len(part.Features) != 1 || part.Features[0] != "x" {
				t.Errorf("%d rows: part has %d classes, features %v", tc.n, part.NumClasses, part.Features)
			}
			for k, x := range part.X {
				i := int(x[0])
				seen[i]++
				if part.Y[k] != i%2 {
					t.Errorf("%d rows: row %d has label %d, want %d", tc.n, i, part.Y[k], i%2)
				}
			}
		}
		for i, c := range seen {
			if c != 1 {
				t.Errorf("%d rows, frac %v: row %d is in %d parts, want 1", tc.n, tc.frac, i, c)
			}
		}
	}
}

// TestLoadCSV: LoadCSV parses a file as Parse does, and its errors name the file and still match
// ErrFormat (or the file system's error for a file that is not there).
func TestLoadCSV(t *testing.T) {
	dir := t.TempDir()
	good, bad := filepath.Join(dir, "good.csv"), filepath.Join(dir, "bad.csv")
	if err := os.WriteFile(good, []byte("a,label\n1,0\n2,1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bad, []byte("a,label\n1,x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if s, err := LoadCSV(good); err != nil || s.Len() != 2 || s.NumClasses != 2 {
		t.Errorf("LoadCSV(good) = %+v, %v", s, err)
	}
	if _, err := LoadCSV(bad); !errors.Is(err, ErrFormat) || !strings.Contains(err.Error(), bad) {
		t.Errorf("LoadCSV(bad) = %v, want ErrFormat naming %s", err, bad)
	}
	if _, err := LoadCSV(filepath.Join(dir, "none.csv")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("LoadCSV(missing) = %v, want fs.ErrNotExist", err)
	}
}
