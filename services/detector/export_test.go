package detector

import (
	"context"

	"github.com/imagefleet/imagefleet/events"
)

// SetStoreWrite makes svc's records writes call write, which gets the real store write to call or not.
func SetStoreWrite(svc *Service, write func(ctx context.Context, puts []events.ImageRecord, deletes []string,
	real func(context.Context, []events.ImageRecord, []string) error) error) {
	svc.storeWrite = func(ctx context.Context, puts []events.ImageRecord, deletes []string) error {
		return write(ctx, puts, deletes, svc.store.Write)
	}
}
