// Package gradcheck holds the central finite difference that the tests hold analytic gradients
// to.
package gradcheck

// Central calls each(i, j, fd) for every component j of every parameter block values[i], with fd
// the central difference of loss there,
//
//	fd = (loss(w + h e_j) - loss(w - h e_j)) / 2h,
//
// moving values[i][j] by h each way and putting it back before the next component. loss reads
// the values and must not change them; a loss that also writes a gradient must not write the one
// the caller compares fd with.
func Central(values [][]float64, h float64, loss func() float64, each func(i, j int, fd float64)) {
	for i, v := range values {
		for j, w := range v {
			v[j] = w + h
			up := loss()
			v[j] = w - h
			down := loss()
			v[j] = w
			each(i, j, (up-down)/(2*h))
		}
	}
}
