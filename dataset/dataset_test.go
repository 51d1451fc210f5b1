package dataset

import (
	"errors"
	"fmt"
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
