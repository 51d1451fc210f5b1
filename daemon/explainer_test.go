package daemon

import (
	"slices"
	"strings"
	"testing"

	"github.com/cfguard/cfguard/assets"
	"github.com/cfguard/cfguard/bnn"
)

// TestVAEDataMustBeTheModelsFeatures: the VAE of PSCE's plausibility term is trained on
// model.dataset only when its rows are the model's features, by name when the model names them.
func TestVAEDataMustBeTheModelsFeatures(t *testing.T) {
	m, err := bnn.Load(sharedModelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	bc, _, err := assets.Load("breast_cancer")
	if err != nil {
		t.Fatal(err)
	}
	gc, _, err := assets.Load("german_credit")
	if err != nil {
		t.Fatal(err)
	}
	with := func(features []string) *bnn.Model {
		c := *m
		c.Features = features
		return &c
	}
	renamed := slices.Clone(m.Features)
	renamed[3] = "f3"
	for _, tc := range []struct {
		name  string
		model *bnn.Model
		rows  []string // the data set's features
		want  string   // in the error; "" for none
	}{
		{"the model's own data", m, bc.Features, ""},
		{"a model without feature names", with(nil), bc.Features, ""},
		{"a renamed feature", with(renamed), bc.Features, `feature 3 is "mean area" in the data set, "f3" in the model`},
		{"features in another order", with(append(slices.Clone(m.Features[1:]), m.Features[0])), bc.Features, "feature 0 is"},
		{"another data set", m, gc.Features, "the data set has"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := *bc
			set.Features = tc.rows
			err := vaeDataFits(&set, tc.model)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("got %v, want an error with %q", err, tc.want)
			}
		})
	}
}
