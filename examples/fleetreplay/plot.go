package main

import (
	"fmt"
	"image/color"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

var armStyle = map[string]struct {
	c     color.Color
	shape draw.GlyphDrawer
}{
	"without P2P": {color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, draw.CircleGlyph{}},
	"with P2P":    {color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, draw.TriangleGlyph{}},
}

// plotArms draws the per-request TTFT of a pair of arms (without and with
// P2P) and saves it as PNG and SVG under dir; it returns the paths. A burst
// is drawn by arrival order, a steady load by arrival time.
func plotArms(dir, base, title string, arms []*armResult) ([]string, error) {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = "time to first token (s)"
	burst := len(arms) > 0 && arms[0].Rate == 0
	if burst {
		p.X.Label.Text = "branch, in arrival order"
	} else {
		p.X.Label.Text = "arrival time (s)"
	}
	p.Add(plotter.NewGrid())
	p.Legend.Top = true
	p.Legend.Left = true
	for _, a := range arms {
		pts := make(plotter.XYs, len(a.ttft))
		for i, v := range a.ttft {
			pts[i].X, pts[i].Y = float64(i), v
			if !burst {
				pts[i].X = a.arrival[i]
			}
		}
		st := armStyle[a.Arm]
		s, err := plotter.NewScatter(pts)
		if err != nil {
			return nil, fmt.Errorf("plot %s: %w", base, err)
		}
		s.GlyphStyle.Color = st.c
		s.GlyphStyle.Shape = st.shape
		s.GlyphStyle.Radius = vg.Points(2.5)
		if !burst {
			s.GlyphStyle.Radius = vg.Points(1.5)
		}
		p.Add(s)
		p.Legend.Add(fmt.Sprintf("%s (p50 %.2f s, p90 %.2f s)", a.Arm, a.P50, a.P90), s)
		if burst {
			l, err := plotter.NewLine(pts)
			if err != nil {
				return nil, fmt.Errorf("plot %s: %w", base, err)
			}
			l.LineStyle.Color = st.c
			l.LineStyle.Width = vg.Points(0.75)
			p.Add(l)
		}
	}
	p.Y.Min = 0
	// Headroom for the legend above the highest point.
	p.Y.Max *= 1.3
	var paths []string
	for _, ext := range []string{".png", ".svg"} {
		path := filepath.Join(dir, base+ext)
		if err := p.Save(9*vg.Inch, 4.5*vg.Inch, path); err != nil {
			return nil, fmt.Errorf("plot %s: %w", path, err)
		}
		paths = append(paths, path)
	}
	return paths, nil
}
