package assets

import (
	"strings"
	"testing"
)

// TestLoadEveryBundled parses every bundled data set (the gzip-compressed MNIST subset too) and
// checks the shape, classes and value range PROVENANCE.md states.
func TestLoadEveryBundled(t *testing.T) {
	want := map[string]struct {
		rows, features, classes int
		max                     float64
	}{
		"breast_cancer": {569, 30, 2, 4254},
		"german_credit": {1000, 61, 2, 18424},
		"spambase":      {4601, 57, 2, 15841},
		"digits":        {1797, 64, 10, 16},
		"mnist":         {2000, 784, 10, 255},
	}
	if got := strings.Join(Names(), ","); got != "breast_cancer,digits,german_credit,mnist,spambase" {
		t.Errorf("Names() = %s", got)
	}
	for _, name := range Names() {
		s, d, err := Load(name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		w := want[name]
		if len(s.X) != w.rows || len(s.X[0]) != w.features || s.NumClasses != w.classes || len(d.Classes) != w.classes {
			t.Errorf("%s: %d x %d, %d classes (%d names), want %d x %d, %d", name, len(s.X), len(s.X[0]), s.NumClasses, len(d.Classes), w.rows, w.features, w.classes)
		}
		mx := 0.0
		for _, x := range s.X {
			for _, v := range x {
				mx = max(mx, v)
			}
		}
		if mx != w.max {
			t.Errorf("%s: largest value %v, want %v", name, mx, w.max)
		}
		if name == "mnist" {
			count := make([]int, 10)
			for _, y := range s.Y {
				count[y]++
			}
			for c, n := range count {
				if n != 200 {
					t.Errorf("mnist class %d has %d rows, want 200", c, n)
				}
			}
		}
	}
}

// Lookup knows exactly the bundled data sets; class names follow PROVENANCE.md's label mapping
// (breast_cancer: 0 = malignant, 212 rows; 1 = benign, 357 rows); Provenance is the notes file.
func TestLookupClassesAndProvenance(t *testing.T) {
	if d, ok := Lookup("nope"); ok {
		t.Errorf("Lookup(nope) = %+v, true", d)
	}
	d, ok := Lookup("breast_cancer")
	if !ok || d.Name != "breast_cancer" || strings.Join(d.Classes, ",") != "malignant,benign" {
		t.Fatalf("Lookup(breast_cancer) = %+v, %v", d, ok)
	}
	s, _, err := Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	count := [2]int{}
	for _, y := range s.Y {
		count[y]++
	}
	if count != [2]int{212, 357} {
		t.Errorf("breast_cancer class counts %v, want [212 357] (0 = malignant)", count)
	}
	p := Provenance()
	for _, name := range Names() {
		if d, _ := Lookup(name); !strings.Contains(p, d.File) {
			t.Errorf("Provenance() does not mention %s", d.File)
		}
	}
}
