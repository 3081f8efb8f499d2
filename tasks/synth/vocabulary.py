"""Fixed word lists the language tasks draw from (tuples: order is part of determinism)."""

WORDS = ("apple", "anchor", "arrow", "autumn", "badge", "bakery", "banner", "barrel", "basket", "beacon", "blanket", "bottle", "bridge", "bucket", "butter", "cabin", "camera", "candle", "canvas", "carpet", "castle", "cellar", "chalk", "cherry", "circle", "clock", "cloud", "copper", "cotton", "crayon", "dagger", "desert", "dinner", "dragon", "drawer", "eagle", "easel", "engine", "falcon", "feather", "fence", "forest", "fossil", "garden", "garlic", "glacier", "gravel", "guitar", "hammer", "harbor", "helmet", "honey", "island", "jacket", "jungle", "kettle", "ladder", "lantern", "lemon", "lizard", "magnet", "marble", "meadow", "mirror", "monkey", "needle", "nickel", "number", "oyster", "paddle", "palace", "pencil", "pepper", "pillow", "planet", "pocket", "puzzle", "rabbit", "ribbon", "river", "rocket", "saddle", "salmon", "sandal", "shadow", "silver", "spider", "spoon", "statue", "summer", "teapot", "ticket", "timber", "tomato", "tunnel", "turtle", "valley", "velvet", "violin", "wagon", "walnut", "window", "winter", "wizard", "yogurt", "zipper", "orbit", "quartz", "vessel", "harvest", "compass", "thimble", "walrus", "muffin", "pebble", "trumpet")

NAMES = (
    "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy",
    "Kevin", "Laura", "Mallory", "Niaj", "Olivia", "Peggy", "Quentin", "Rupert", "Sybil", "Trent",
)

GOODS = (
    "apple", "book", "candle", "drum", "emerald", "flute", "glove", "hat", "ink pot", "jar of honey",
    "kite", "lamp", "map", "necklace", "orange", "pearl", "quilt", "ruby", "scarf", "teapot",
)

CATEGORIES = {
    "fruits": ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum", "orange"),
    "vegetables": ("carrot", "potato", "onion", "cabbage", "lettuce", "celery", "yam", "garlic"),
    "musical instruments": ("piano", "flute", "violin", "drum", "trumpet", "guitar", "clarinet"),
    "animals": ("cat", "dog", "goat", "rabbit", "snake", "cow", "pig", "duck", "donkey"),
}

COLORS = ("red", "blue", "green", "yellow", "purple", "black", "white", "orange")
OBJECT_KINDS = ("ball", "pen", "cup", "book", "key", "hat", "sock", "box", "mug", "scarf")
MATERIALS = ("wooden", "metal", "plastic", "glass")

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
