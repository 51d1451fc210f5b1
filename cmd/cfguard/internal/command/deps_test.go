package command

import (
	"os/exec"
	"strings"
	"testing"
)

// experimentOnly are import-path prefixes of what the paper's experiments need and the sidecar
// does not: plotting (gonum.org/v1/plot and its SVG, raster and TeX back ends), fonts and PDF.
var experimentOnly = []string{
	"gonum.org/v1/plot",
	"codeberg.org/go-fonts/",
	"codeberg.org/go-pdf/",
	"codeberg.org/go-latex/",
	"golang.org/x/image/font",
	"github.com/golang/freetype",
	"github.com/ajstarks/svgo",
	"git.sr.ht/~sbinet/gg",
}

// goList returns `go list -deps pkg`, one import path per element.
func goList(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

func experimentDeps(deps []string) []string {
	var bad []string
	for _, d := range deps {
		for _, p := range experimentOnly {
			if strings.HasPrefix(d, p) {
				bad = append(bad, d)
				break
			}
		}
	}
	return bad
}

// TestSidecarLinksNoExperimentPackages: the sidecar binary links no plotting, font or PDF
// package; those belong to cmd/cfguard-lab. The lab command is checked to link them, so that the
// prefixes above are known to match what the experiments pull in.
func TestSidecarLinksNoExperimentPackages(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list twice")
	}
	if bad := experimentDeps(goList(t, "github.com/cfguard/cfguard/cmd/cfguard")); len(bad) > 0 {
		t.Errorf("cmd/cfguard links %d experiment-only packages (move their users to cmd/cfguard-lab): %v", len(bad), bad)
	}
	lab := experimentDeps(goList(t, "github.com/cfguard/cfguard/cmd/cfguard-lab"))
	if !strings.Contains(strings.Join(lab, " "), "gonum.org/v1/plot/vg/vgpdf") {
		t.Errorf("cmd/cfguard-lab's experiment-only packages %v lack gonum.org/v1/plot/vg/vgpdf: the check above would not see them", lab)
	}
}
