package armsim

import (
	"fmt"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// The Azure Retail Prices API (learn.microsoft.com/rest/api/cost-management/retail-prices/azure-retail-prices),
// served at /api/retail/prices beside ARM (Azure serves it at
// prices.azure.com, without authentication): its $filter of
// "<field> eq '<value>'" joined by "and", on the fields its page lists,
// values case-sensitive (2023-01-01-preview on); pages of 100 items with
// NextPageLink; for each VM size and location its meters as the API has
// them: Linux pay-as-you-go ("NC4as T4 v3"), Spot ("NC4as T4 v3 Spot"),
// Low Priority (Batch's), Windows (a product "... Series Windows"),
// and a one-year reservation, each priced apart.

// RetailPrices are the stand-in's pay-as-you-go Linux prices (USD an
// hour) in eastus, Azure's published ones for these sizes
// (azure.microsoft.com/pricing/details/virtual-machines/linux); other
// locations cost a fixed share more (LocationFactor). A size not here
// has no meter.
var RetailPrices = map[string]float64{
	"Standard_D2s_v5": 0.096, "Standard_D4s_v5": 0.192, "Standard_D8s_v5": 0.384,
	"Standard_NC6s_v3": 3.06, "Standard_NC4as_T4_v3": 0.526, "Standard_NC8as_T4_v3": 0.752,
	"Standard_NC16as_T4_v3": 1.204, "Standard_NC64as_T4_v3": 4.352,
	"Standard_NC24ads_A100_v4": 3.673, "Standard_ND96asr_v4": 27.197, "Standard_NC40ads_H100_v5": 6.98,
}

// LocationFactor is what a size costs in a location, against eastus.
var LocationFactor = map[string]float64{"eastus": 1, "westus2": 1, "northeurope": 1.1, "westeurope": 1.15}

// SpotShare is a Spot meter's price against pay-as-you-go.
const SpotShare = 0.2

// RetailPrice is the price of a size's Linux meter in a location, Spot
// or not, as the stand-in lists it.
func RetailPrice(size, location string, spot bool) float64 {
	p := RetailPrices[size] * LocationFactor[location]
	if spot {
		p *= SpotShare
	}
	return roundPrice(p)
}

func roundPrice(p float64) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(p, 'f', 6, 64), 64)
	return v
}

var (
	filterTerm = regexp.MustCompile(`^([A-Za-z]+) eq '((?:[^']|'')*)'$`)
	// filterFields are the fields the API's page says $filter takes.
	filterFields = map[string]bool{
		"armRegionName": true, "location": true, "meterId": true, "meterName": true, "productid": true, "skuId": true,
		"productName": true, "skuName": true, "serviceName": true, "serviceId": true, "serviceFamily": true,
		"priceType": true, "armSkuName": true,
	}
)

// retailItem is one meter's price.
type retailItem map[string]any

func (s *Server) retailPrices(w http.ResponseWriter, r *http.Request) {
	s.count("retail prices")
	if r.Method != http.MethodGet {
		writeJSON(w, http.StatusMethodNotAllowed, map[string]any{"Error": map[string]string{"Code": "MethodNotAllowed"}})
		return
	}
	var terms [][2]string
	if f := strings.TrimSpace(r.URL.Query().Get("$filter")); f != "" {
		for part := range strings.SplitSeq(f, " and ") {
			m := filterTerm.FindStringSubmatch(strings.TrimSpace(part))
			if m == nil || !filterFields[m[1]] {
				writeJSON(w, http.StatusBadRequest, map[string]any{"Error": map[string]string{"Code": "BadRequest", "Message": fmt.Sprintf("Invalid OData parameters supplied: %q", part)}})
				return
			}
			terms = append(terms, [2]string{m[1], strings.ReplaceAll(m[2], "''", "'")})
		}
	}
	var match []retailItem
	for _, it := range retailItems() {
		ok := true
		for _, t := range terms {
			field := t[0]
			if field == "priceType" {
				field = "type"
			}
			if v, _ := it[field].(string); v != t[1] {
				ok = false
				break
			}
		}
		if ok {
			match = append(match, it)
		}
	}
	skip, _ := strconv.Atoi(r.URL.Query().Get("$skip"))
	skip = min(max(skip, 0), len(match))
	end := min(skip+100, len(match))
	out := map[string]any{"BillingCurrency": "USD", "CustomerEntityId": "Default", "CustomerEntityType": "Retail",
		"Items": match[skip:end], "Count": end - skip, "NextPageLink": nil}
	if end < len(match) {
		q := r.URL.Query()
		q.Set("$skip", strconv.Itoa(end))
		out["NextPageLink"] = s.URL + "/api/retail/prices?" + q.Encode()
	}
	writeJSON(w, http.StatusOK, out)
}

// retailItems are the meters of every size priced, in every location.
func retailItems() []retailItem {
	var out []retailItem
	for _, size := range slices.Sorted(maps.Keys(RetailPrices)) {
		short := strings.ReplaceAll(strings.TrimPrefix(size, "Standard_"), "_", " ")
		product := "Virtual Machines " + strings.TrimPrefix(size, "Standard_") + " Series"
		for _, loc := range Locations {
			item := func(typ, sku, product string, price float64) retailItem {
				return retailItem{
					"currencyCode": "USD", "tierMinimumUnits": 0.0, "retailPrice": price, "unitPrice": price,
					"armRegionName": loc, "location": loc, "effectiveStartDate": "2026-11-01T00:00:00Z",
					"meterName": sku, "productName": product, "skuName": sku, "serviceName": "Virtual Machines",
					"serviceFamily": "Compute", "unitOfMeasure": "1 Hour", "type": typ, "isPrimaryMeterRegion": true,
					"armSkuName": size,
				}
			}
			linux := RetailPrice(size, loc, false)
			res := item("Reservation", short, product, roundPrice(linux*0.6*8760))
			res["reservationTerm"] = "1 Year"
			out = append(out,
				item("Consumption", short, product+" Windows", roundPrice(linux+0.046*float64(sizeInfos[size].vcpus))),
				item("Consumption", short+" Low Priority", product, roundPrice(linux*0.2)),
				item("DevTestConsumption", short, product, roundPrice(linux*0.9)),
				res,
				item("Consumption", short+" Spot", product+" Windows", roundPrice(RetailPrice(size, loc, true)+0.01)),
				item("Consumption", short+" Spot", product, RetailPrice(size, loc, true)),
				item("Consumption", short, product, linux),
			)
		}
	}
	return out
}
