"""Class names and zero-shot prompt templates for the 8-task CLIP benchmark.

The class names and prompts are the ones the CLIP task-vector literature (and
FusionBench, whose task names are used as keys) uses for SUN397, Stanford
Cars, RESISC45, EuroSAT, SVHN, GTSRB, MNIST and DTD. Class ``k`` of a list is
label ``k`` of the dataset as FusionBench distributes it. A template is a
``str.format`` pattern with one ``{}`` for the class name.

Registry: ``TASKS`` maps a task name to ``(classes, templates)``;
:func:`classes_and_templates` looks one up (aliases such as ``stanford_cars``
or ``tanganke/sun397`` are accepted).
"""

from __future__ import annotations


def _lines(block: str) -> tuple[str, ...]:
    """One class name per non-empty line of ``block``."""
    return tuple(line.strip() for line in block.strip().splitlines() if line.strip())


SUN397 = _lines("""
abbey
airplane cabin
airport terminal
alley
amphitheater
amusement arcade
amusement park
anechoic chamber
apartment building outdoor
apse indoor
aquarium
aqueduct
arch
archive
arrival gate outdoor
art gallery
art school
art studio
assembly line
athletic field outdoor
atrium public
attic
auditorium
auto factory
badlands
badminton court indoor
baggage claim
bakery shop
balcony exterior
balcony interior
ball pit
ballroom
bamboo forest
banquet hall
bar
barn
barndoor
baseball field
basement
basilica
basketball court outdoor
bathroom
batters box
bayou
bazaar indoor
bazaar outdoor
beach
beauty salon
bedroom
berth
biology laboratory
bistro indoor
boardwalk
boat deck
boathouse
bookstore
booth indoor
botanical garden
bow window indoor
bow window outdoor
bowling alley
boxing ring
brewery indoor
bridge
building facade
bullring
burial chamber
bus interior
butchers shop
butte
cabin outdoor
cafeteria
campsite
campus
canal natural
canal urban
candy store
canyon
car interior backseat
car interior frontseat
carrousel
casino indoor
castle
catacomb
cathedral indoor
cathedral outdoor
cavern indoor
cemetery
chalet
cheese factory
chemistry lab
chicken coop indoor
chicken coop outdoor
childs room
church indoor
church outdoor
classroom
clean room
cliff
cloister indoor
closet
clothing store
coast
cockpit
coffee shop
computer room
conference center
conference room
construction site
control room
control tower outdoor
corn field
corral
corridor
cottage garden
courthouse
courtroom
courtyard
covered bridge exterior
creek
crevasse
crosswalk
cubicle office
dam
delicatessen
dentists office
desert sand
desert vegetation
diner indoor
diner outdoor
dinette home
dinette vehicle
dining car
dining room
discotheque
dock
doorway outdoor
dorm room
driveway
driving range outdoor
drugstore
electrical substation
elevator door
elevator interior
elevator shaft
engine room
escalator indoor
excavation
factory indoor
fairway
fastfood restaurant
field cultivated
field wild
fire escape
fire station
firing range indoor
fishpond
florist shop indoor
food court
forest broadleaf
forest needleleaf
forest path
forest road
formal garden
fountain
galley
game room
garage indoor
garbage dump
gas station
gazebo exterior
general store indoor
general store outdoor
gift shop
golf course
greenhouse indoor
greenhouse outdoor
gymnasium indoor
hangar indoor
hangar outdoor
harbor
hayfield
heliport
herb garden
highway
hill
home office
hospital
hospital room
hot spring
hot tub outdoor
hotel outdoor
hotel room
house
hunting lodge outdoor
ice cream parlor
ice floe
ice shelf
ice skating rink indoor
ice skating rink outdoor
iceberg
igloo
industrial area
inn outdoor
islet
jacuzzi indoor
jail cell
jail indoor
jewelry shop
kasbah
kennel indoor
kennel outdoor
kindergarden classroom
kitchen
kitchenette
labyrinth outdoor
lake natural
landfill
landing deck
laundromat
lecture room
library indoor
library outdoor
lido deck outdoor
lift bridge
lighthouse
limousine interior
living room
lobby
lock chamber
locker room
mansion
manufactured home
market indoor
market outdoor
marsh
martial arts gym
mausoleum
medina
moat water
monastery outdoor
mosque indoor
mosque outdoor
motel
mountain
mountain snowy
movie theater indoor
museum indoor
music store
music studio
nuclear power plant outdoor
nursery
oast house
observatory outdoor
ocean
office
office building
oil refinery outdoor
oilrig
operating room
orchard
outhouse outdoor
pagoda
palace
pantry
park
parking garage indoor
parking garage outdoor
parking lot
parlor
pasture
patio
pavilion
pharmacy
phone booth
physics laboratory
picnic area
pilothouse indoor
planetarium outdoor
playground
playroom
plaza
podium indoor
podium outdoor
pond
poolroom establishment
poolroom home
power plant outdoor
promenade deck
pub indoor
pulpit
putting green
racecourse
raceway
raft
railroad track
rainforest
reception
recreation room
residential neighborhood
restaurant
restaurant kitchen
restaurant patio
rice paddy
riding arena
river
rock arch
rope bridge
ruin
runway
sandbar
sandbox
sauna
schoolhouse
sea cliff
server room
shed
shoe shop
shopfront
shopping mall indoor
shower
skatepark
ski lodge
ski resort
ski slope
sky
skyscraper
slum
snowfield
squash court
stable
stadium baseball
stadium football
stage indoor
staircase
street
subway interior
subway station platform
supermarket
sushi bar
swamp
swimming pool indoor
swimming pool outdoor
synagogue indoor
synagogue outdoor
television studio
temple east asia
temple south asia
tennis court indoor
tennis court outdoor
tent outdoor
theater indoor procenium
theater indoor seats
thriftshop
throne room
ticket booth
toll plaza
topiary garden
tower
toyshop
track outdoor
train railway
train station platform
tree farm
tree house
trench
underwater coral reef
utility room
valley
van interior
vegetable garden
veranda
veterinarians office
viaduct
videostore
village
vineyard
volcano
volleyball court indoor
volleyball court outdoor
waiting room
warehouse indoor
water tower
waterfall block
waterfall fan
waterfall plunge
watering hole
wave
wet bar
wheat field
wind farm
windmill
wine cellar barrel storage
wine cellar bottle storage
wrestling ring indoor
yard
youth hostel
""")

STANFORD_CARS = _lines("""
AM General Hummer SUV 2000
Acura RL Sedan 2012
Acura TL Sedan 2012
Acura TL Type-S 2008
Acura TSX Sedan 2012
Acura Integra Type R 2001
Acura ZDX Hatchback 2012
Aston Martin V8 Vantage Convertible 2012
Aston Martin V8 Vantage Coupe 2012
Aston Martin Virage Convertible 2012
Aston Martin Virage Coupe 2012
Audi RS 4 Convertible 2008
Audi A5 Coupe 2012
Audi TTS Coupe 2012
Audi R8 Coupe 2012
Audi V8 Sedan 1994
Audi 100 Sedan 1994
Audi 100 Wagon 1994
Audi TT Hatchback 2011
Audi S6 Sedan 2011
Audi S5 Convertible 2012
Audi S5 Coupe 2012
Audi S4 Sedan 2012
Audi S4 Sedan 2007
Audi TT RS Coupe 2012
BMW ActiveHybrid 5 Sedan 2012
BMW 1 Series Convertible 2012
BMW 1 Series Coupe 2012
BMW 3 Series Sedan 2012
BMW 3 Series Wagon 2012
BMW 6 Series Convertible 2007
BMW X5 SUV 2007
BMW X6 SUV 2012
BMW M3 Coupe 2012
BMW M5 Sedan 2010
BMW M6 Convertible 2010
BMW X3 SUV 2012
BMW Z4 Convertible 2012
Bentley Continental Supersports Conv. Convertible 2012
Bentley Arnage Sedan 2009
Bentley Mulsanne Sedan 2011
Bentley Continental GT Coupe 2012
Bentley Continental GT Coupe 2007
Bentley Continental Flying Spur Sedan 2007
Bugatti Veyron 16.4 Convertible 2009
Bugatti Veyron 16.4 Coupe 2009
Buick Regal GS 2012
Buick Rainier SUV 2007
Buick Verano Sedan 2012
Buick Enclave SUV 2012
Cadillac CTS-V Sedan 2012
Cadillac SRX SUV 2012
Cadillac Escalade EXT Crew Cab 2007
Chevrolet Silverado 1500 Hybrid Crew Cab 2012
Chevrolet Corvette Convertible 2012
Chevrolet Corvette ZR1 2012
Chevrolet Corvette Ron Fellows Edition Z06 2007
Chevrolet Traverse SUV 2012
Chevrolet Camaro Convertible 2012
Chevrolet HHR SS 2010
Chevrolet Impala Sedan 2007
Chevrolet Tahoe Hybrid SUV 2012
Chevrolet Sonic Sedan 2012
Chevrolet Express Cargo Van 2007
Chevrolet Avalanche Crew Cab 2012
Chevrolet Cobalt SS 2010
Chevrolet Malibu Hybrid Sedan 2010
Chevrolet TrailBlazer SS 2009
Chevrolet Silverado 2500HD Regular Cab 2012
Chevrolet Silverado 1500 Classic Extended Cab 2007
Chevrolet Express Van 2007
Chevrolet Monte Carlo Coupe 2007
Chevrolet Malibu Sedan 2007
Chevrolet Silverado 1500 Extended Cab 2012
Chevrolet Silverado 1500 Regular Cab 2012
Chrysler Aspen SUV 2009
Chrysler Sebring Convertible 2010
Chrysler Town and Country Minivan 2012
Chrysler 300 SRT-8 2010
Chrysler Crossfire Convertible 2008
Chrysler PT Cruiser Convertible 2008
Daewoo Nubira Wagon 2002
Dodge Caliber Wagon 2012
Dodge Caliber Wagon 2007
Dodge Caravan Minivan 1997
Dodge Ram Pickup 3500 Crew Cab 2010
Dodge Ram Pickup 3500 Quad Cab 2009
Dodge Sprinter Cargo Van 2009
Dodge Journey SUV 2012
Dodge Dakota Crew Cab 2010
Dodge Dakota Club Cab 2007
Dodge Magnum Wagon 2008
Dodge Challenger SRT8 2011
Dodge Durango SUV 2012
Dodge Durango SUV 2007
Dodge Charger Sedan 2012
Dodge Charger SRT-8 2009
Eagle Talon Hatchback 1998
FIAT 500 Abarth 2012
FIAT 500 Convertible 2012
Ferrari FF Coupe 2012
Ferrari California Convertible 2012
Ferrari 458 Italia Convertible 2012
Ferrari 458 Italia Coupe 2012
Fisker Karma Sedan 2012
Ford F-450 Super Duty Crew Cab 2012
Ford Mustang Convertible 2007
Ford Freestar Minivan 2007
Ford Expedition EL SUV 2009
Ford Edge SUV 2012
Ford Ranger SuperCab 2011
Ford GT Coupe 2006
Ford F-150 Regular Cab 2012
Ford F-150 Regular Cab 2007
Ford Focus Sedan 2007
Ford E-Series Wagon Van 2012
Ford Fiesta Sedan 2012
GMC Terrain SUV 2012
GMC Savana Van 2012
GMC Yukon Hybrid SUV 2012
GMC Acadia SUV 2012
GMC Canyon Extended Cab 2012
Geo Metro Convertible 1993
HUMMER H3T Crew Cab 2010
HUMMER H2 SUT Crew Cab 2009
Honda Odyssey Minivan 2012
Honda Odyssey Minivan 2007
Honda Accord Coupe 2012
Honda Accord Sedan 2012
Hyundai Veloster Hatchback 2012
Hyundai Santa Fe SUV 2012
Hyundai Tucson SUV 2012
Hyundai Veracruz SUV 2012
Hyundai Sonata Hybrid Sedan 2012
Hyundai Elantra Sedan 2007
Hyundai Accent Sedan 2012
Hyundai Genesis Sedan 2012
Hyundai Sonata Sedan 2012
Hyundai Elantra Touring Hatchback 2012
Hyundai Azera Sedan 2012
Infiniti G Coupe IPL 2012
Infiniti QX56 SUV 2011
Isuzu Ascender SUV 2008
Jaguar XK XKR 2012
Jeep Patriot SUV 2012
Jeep Wrangler SUV 2012
Jeep Liberty SUV 2012
Jeep Grand Cherokee SUV 2012
Jeep Compass SUV 2012
Lamborghini Reventon Coupe 2008
Lamborghini Aventador Coupe 2012
Lamborghini Gallardo LP 570-4 Superleggera 2012
Lamborghini Diablo Coupe 2001
Land Rover Range Rover SUV 2012
Land Rover LR2 SUV 2012
Lincoln Town Car Sedan 2011
MINI Cooper Roadster Convertible 2012
Maybach Landaulet Convertible 2012
Mazda Tribute SUV 2011
McLaren MP4-12C Coupe 2012
Mercedes-Benz 300-Class Convertible 1993
Mercedes-Benz C-Class Sedan 2012
Mercedes-Benz SL-Class Coupe 2009
Mercedes-Benz E-Class Sedan 2012
Mercedes-Benz S-Class Sedan 2012
Mercedes-Benz Sprinter Van 2012
Mitsubishi Lancer Sedan 2012
Nissan Leaf Hatchback 2012
Nissan NV Passenger Van 2012
Nissan Juke Hatchback 2012
Nissan 240SX Coupe 1998
Plymouth Neon Coupe 1999
Porsche Panamera Sedan 2012
Ram C/V Cargo Van Minivan 2012
Rolls-Royce Phantom Drophead Coupe Convertible 2012
Rolls-Royce Ghost Sedan 2012
Rolls-Royce Phantom Sedan 2012
Scion xD Hatchback 2012
Spyker C8 Convertible 2009
Spyker C8 Coupe 2009
Suzuki Aerio Sedan 2007
Suzuki Kizashi Sedan 2012
Suzuki SX4 Hatchback 2012
Suzuki SX4 Sedan 2012
Tesla Model S Sedan 2012
Toyota Sequoia SUV 2012
Toyota Camry Sedan 2012
Toyota Corolla Sedan 2012
Toyota 4Runner SUV 2012
Volkswagen Golf Hatchback 2012
Volkswagen Golf Hatchback 1991
Volkswagen Beetle Hatchback 2012
Volvo C30 Hatchback 2012
Volvo 240 Sedan 1993
Volvo XC90 SUV 2007
smart fortwo Convertible 2012
""")

RESISC45 = _lines("""
airplane
airport
baseball diamond
basketball court
beach
bridge
chaparral
church
circular farmland
cloud
commercial area
dense residential
desert
forest
freeway
golf course
ground track field
harbor
industrial area
intersection
island
lake
meadow
medium residential
mobile home park
mountain
overpass
palace
parking lot
railway
railway station
rectangular farmland
river
roundabout
runway
sea ice
ship
snowberg
sparse residential
stadium
storage tank
tennis court
terrace
thermal power station
wetland
""")

EUROSAT = _lines("""
annual crop land
forest
brushland or shrubland
highway or road
industrial buildings or commercial buildings
pasture land
permanent crop land
residential buildings or homes or apartments
river
lake or sea
""")

SVHN = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

MNIST = tuple(str(d) for d in range(10))

GTSRB = _lines("""
red and white circle 20 kph speed limit
red and white circle 30 kph speed limit
red and white circle 50 kph speed limit
red and white circle 60 kph speed limit
red and white circle 70 kph speed limit
red and white circle 80 kph speed limit
end / de-restriction of 80 kph speed limit
red and white circle 100 kph speed limit
red and white circle 120 kph speed limit
red and white circle red car and black car no passing
red and white circle red truck and black car no passing
red and white triangle road intersection warning
white and yellow diamond priority road
red and white upside down triangle yield right-of-way
stop
empty red and white circle
red and white circle no truck entry
red circle with white horizonal stripe no entry
red and white triangle with exclamation mark warning
red and white triangle with black left curve approaching warning
red and white triangle with black right curve approaching warning
red and white triangle with black double curve approaching warning
red and white triangle rough / bumpy road warning
red and white triangle car skidding / slipping warning
red and white triangle with merging / narrow lanes warning
red and white triangle with person digging / construction / road work warning
red and white triangle with traffic light approaching warning
red and white triangle with person walking warning
red and white triangle with child and person walking warning
red and white triangle with bicyle warning
red and white triangle with snowflake / ice warning
red and white triangle with deer warning
white circle with gray strike bar no speed limit
blue circle with white right turn arrow mandatory
blue circle with white left turn arrow mandatory
blue circle with white forward arrow mandatory
blue circle with white forward or right turn arrow mandatory
blue circle with white forward or left turn arrow mandatory
blue circle with white keep right arrow mandatory
blue circle with white keep left arrow mandatory
blue circle with white arrows indicating a traffic circle
white circle with gray strike bar indicating no passing for cars has ended
white circle with gray strike bar indicating no passing for trucks has ended
""")

DTD = _lines("""
banded
blotchy
braided
bubbly
bumpy
chequered
cobwebbed
cracked
crosshatched
crystalline
dotted
fibrous
flecked
freckled
frilly
gauzy
grid
grooved
honeycombed
interlaced
knitted
lacelike
lined
marbled
matted
meshed
paisley
perforated
pitted
pleated
polka-dotted
porous
potholed
scaly
smeared
spiralled
sprinkled
stained
stratified
striped
studded
swirly
veined
waffled
woven
wrinkled
zigzagged
""")

# Prompt templates: one ``{}`` for the class name.
_PHOTO = ("a photo of a {}.", "a photo of the {}.")
_CARS = _PHOTO + (
    "a photo of my {}.",
    "i love my {}!",
    "a photo of my dirty {}.",
    "a photo of my clean {}.",
    "a photo of my new {}.",
    "a photo of my old {}.",
)
_AERIAL = tuple(
    f"{kind} {what} of {article}{{}}."
    for article in ("", "a ", "the ")
    for what in ("imagery", "photo", "view")
    for kind in ("satellite", "aerial")
)
_EUROSAT = (
    "a centered satellite photo of {}.",
    "a centered satellite photo of a {}.",
    "a centered satellite photo of the {}.",
)
_NUMBER = ('a photo of the number: "{}".',)
_SIGN = (
    'a zoomed in photo of a "{}" traffic sign.',
    'a centered photo of a "{}" traffic sign.',
    'a close up photo of a "{}" traffic sign.',
)
_TEXTURE = tuple(
    f"a photo of {article} {{}} {noun}."
    for article in ("a", "the")
    for noun in ("texture", "pattern", "thing", "object")
)

TASKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sun397": (SUN397, _PHOTO),
    "stanford-cars": (STANFORD_CARS, _CARS),
    "resisc45": (RESISC45, _AERIAL),
    "eurosat": (EUROSAT, _EUROSAT),
    "svhn": (SVHN, _NUMBER),
    "gtsrb": (GTSRB, _SIGN),
    "mnist": (MNIST, _NUMBER),
    "dtd": (DTD, _TEXTURE),
}

# The 8 tasks of the Task Arithmetic benchmark, in the order the paper reports them.
TA8 = ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd")


def canonical_task(name: str) -> str:
    """``tanganke/stanford_cars``, ``Stanford_Cars``, ``stanford-cars`` -> ``stanford-cars``."""
    key = name.rsplit("/", 1)[-1].lower().replace("_", "-")
    return key


def classes_and_templates(task: str) -> tuple[list[str], list[str]]:
    """``(class names, prompt templates)`` of a known task."""
    key = canonical_task(task)
    if key not in TASKS:
        raise KeyError(
            f"no built-in class names for task {task!r}; known tasks: {sorted(TASKS)}. "
            "Give `classes` and `templates` in the spec's head entry instead."
        )
    classes, templates = TASKS[key]
    return list(classes), list(templates)
