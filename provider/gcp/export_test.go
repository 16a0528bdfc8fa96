package gcp

import "github.com/runfleet/runfleet/provider/vm"

// HoldLaunches makes the pool's batch launches wait for open, and says
// the size of each batch as it starts waiting, so that a test can have
// the Creates it makes gather into known batches.
func HoldLaunches(p *Provider, open <-chan struct{}) <-chan int {
	held := make(chan int, 16)
	launch := p.batch.Launch
	p.batch.Launch = func(batch []*vm.Request, spot, fallback bool) {
		held <- len(batch)
		<-open
		launch(batch, spot, fallback)
	}
	return held
}
