// Package assets embeds the data sets bundled with cfguard, so that the daemon and the
// experiments run on a fresh machine with nothing else present. Provenance and licences are in
// data/PROVENANCE.md beside this file.
package assets

import (
	"bytes"
	"compress/gzip"
	"embed"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/cfguard/cfguard/dataset"
)

//go:embed data/*.csv data/*.csv.gz data/PROVENANCE.md
var files embed.FS

// Dataset describes one bundled data set.
type Dataset struct {
	Name    string   // short name, as accepted by Load
	File    string   // file name under data/ (gzip-compressed when it ends in .gz)
	Classes []string // class names by label index
}

var bundled = map[string]Dataset{
	"breast_cancer": {Name: "breast_cancer", File: "breast_cancer.csv", Classes: []string{"malignant", "benign"}},
	"german_credit": {Name: "german_credit", File: "german_credit.csv", Classes: []string{"bad", "good"}},
	"spambase":      {Name: "spambase", File: "spambase.csv", Classes: []string{"nonspam", "spam"}},
	"digits":        {Name: "digits", File: "digits.csv", Classes: digitNames},
	"mnist":         {Name: "mnist", File: "mnist.csv.gz", Classes: digitNames},
}

var digitNames = []string{"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"}

// Names lists the bundled data sets.
func Names() []string {
	var n []string
	for k := range bundled {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

// Lookup returns the description of a bundled data set.
func Lookup(name string) (Dataset, bool) {
	d, ok := bundled[name]
	return d, ok
}

// Load parses a bundled data set.
func Load(name string) (*dataset.Set, Dataset, error) {
	d, ok := bundled[name]
	if !ok {
		return nil, Dataset{}, fmt.Errorf("no bundled data set %q (have %v)", name, Names())
	}
	b, err := files.ReadFile("data/" + d.File)
	if err != nil {
		return nil, d, err
	}
	var r io.Reader = bytes.NewReader(b)
	if strings.HasSuffix(d.File, ".gz") {
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, d, fmt.Errorf("bundled %s: %w", d.File, err)
		}
		defer zr.Close()
		r = zr
	}
	s, err := dataset.Parse(r)
	if err != nil {
		return nil, d, fmt.Errorf("bundled %s: %w", d.File, err)
	}
	return s, d, nil
}

// Provenance returns the provenance and licence notes of the bundled data.
func Provenance() string {
	b, _ := files.ReadFile("data/PROVENANCE.md")
	return string(b)
}
