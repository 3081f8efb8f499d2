"""Procedure tasks: water buckets (planning), dyck reasoning errors and wordscapes (language).

``buckets`` accepts any legal move sequence that reaches the target within the move limit (a BFS
proves the limit reachable); ``dyck_reasoning_errors`` asks which steps of a stack trace are
wrong, each step judged against the step stated before it; ``wordscapes`` fills crossing slots
with words from a letter bag, hinted until exactly one filling of the module's vocabulary fits.
"""
from __future__ import annotations

import functools
import random
import re
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from tasks.synth.base import LevelParams, SynthTask, TaskInstance, normalize_text, uniqueness_check
from tasks.synth.language import BRACKETS, CLOSER, OPENERS, random_dyck

# --- buckets: water jugs ------------------------------------------------------------------------

JUG_NAMES = "ABCD"
_MOVE_SPLIT = re.compile(r"[;\n,]+")
_STEP_NUMBER = re.compile(r"^(?:step\s*)?\(?\d+\s*[.):]\s*")
_FILL_EMPTY = re.compile(r"^(fill|empty)\s+(?:jug\s+)?([a-z])$")
_POUR = re.compile(r"^pour\s+(?:jug\s+)?([a-z])\s+(?:(?:into|to|in|->|→)\s+)?(?:jug\s+)?([a-z])$")

State = tuple[int, ...]
Move = tuple[str, int, int]   # (kind, jug, other jug or -1)


def jug_moves(n: int) -> list[Move]:
    """Every move on n jugs, in a fixed order: fills, empties, then pours."""
    moves: list[Move] = [("fill", i, -1) for i in range(n)] + [("empty", i, -1) for i in range(n)]
    moves += [("pour", i, j) for i in range(n) for j in range(n) if i != j]
    return moves


def apply_move(state: State, capacities: tuple[int, ...], move: Move) -> State:
    kind, i, j = move
    levels = list(state)
    if kind == "fill":
        levels[i] = capacities[i]
    elif kind == "empty":
        levels[i] = 0
    else:
        amount = min(levels[i], capacities[j] - levels[j])
        levels[i] -= amount
        levels[j] += amount
    return tuple(levels)


def format_move(move: Move) -> str:
    kind, i, j = move
    return f"pour {JUG_NAMES[i]} {JUG_NAMES[j]}" if kind == "pour" else f"{kind} {JUG_NAMES[i]}"


@uniqueness_check
def shortest_jug_plans(capacities: tuple[int, ...], start: State) -> dict[int, list[Move]]:
    """For each amount some jug can be made to hold, one shortest move sequence ending with a jug
    holding it (BFS over states; it proves each listed target solvable, and unlisted ones not)."""
    moves = jug_moves(len(capacities))
    parent: dict[State, tuple[State, Move] | None] = {start: None}
    plans: dict[int, State] = {}
    for v in start:
        plans.setdefault(v, start)
    wanted = set(range(1, max(capacities) + 1))
    queue = deque([start])
    while queue and not wanted <= plans.keys():
        state = queue.popleft()
        for move in moves:
            nxt = apply_move(state, capacities, move)
            if nxt in parent:
                continue
            parent[nxt] = (state, move)
            queue.append(nxt)
            for v in nxt:
                plans.setdefault(v, nxt)
    out: dict[int, list[Move]] = {}
    for amount, state in plans.items():
        path: list[Move] = []
        link = parent[state]
        while link is not None:
            state, move = link
            path.append(move)
            link = parent[state]
        out[amount] = path[::-1]
    return out


def parse_jug_moves(answer: str, n: int) -> list[Move] | None:
    """Moves of an answer ("fill A", "empty B", "pour A B"; ';', ',' or newline between them),
    or None when any part is not a legal move on jugs A.. (n jugs)."""
    moves: list[Move] = []
    for part in _MOVE_SPLIT.split(answer):
        text = normalize_text(part).rstrip(".")
        if not text:
            continue
        text = _STEP_NUMBER.sub("", text).strip()
        m = _FILL_EMPTY.match(text)
        if m:
            i = ord(m.group(2)) - ord("a")
            if not 0 <= i < n:
                return None
            moves.append((m.group(1), i, -1))
            continue
        m = _POUR.match(text)
        if not m:
            return None
        i, j = ord(m.group(1)) - ord("a"), ord(m.group(2)) - ord("a")
        if not (0 <= i < n and 0 <= j < n) or i == j:
            return None
        moves.append(("pour", i, j))
    return moves


@dataclass(frozen=True)
class BucketsParams(LevelParams):
    jugs: int
    max_capacity: int
    min_moves: int       # the shortest solution has at least this many moves
    slack: int           # moves allowed beyond the shortest solution
    random_start: bool   # jugs start partly filled instead of empty


class Buckets(SynthTask):
    name = "buckets"
    family = "planning"
    answer_example = "fill A; pour A B; empty B"
    unique_answer = False
    levels = (BucketsParams(2, 7, 2, 2, False), BucketsParams(2, 11, 4, 2, False),
              BucketsParams(3, 9, 4, 1, False), BucketsParams(3, 12, 4, 1, True),
              BucketsParams(3, 15, 6, 0, False), BucketsParams(4, 17, 6, 0, False))

    def build(self, rng: random.Random, p: BucketsParams) -> tuple[str, str, dict[str, Any]]:
        while True:
            capacities = tuple(rng.sample(range(2, p.max_capacity + 1), p.jugs))
            if p.random_start:
                start = tuple(rng.randint(0, c) for c in capacities)
            else:
                start = (0,) * p.jugs
            plans = shortest_jug_plans(capacities, start)
            targets = [t for t in sorted(plans) if 0 < t and len(plans[t]) >= p.min_moves]
            if targets:
                break
        target = rng.choice(targets)
        plan = plans[target]
        max_moves = len(plan) + p.slack
        names = JUG_NAMES[:p.jugs]
        jugs = ", ".join(f"{names[i]} holds up to {c} litres" for i, c in enumerate(capacities))
        if any(start):
            state = ", ".join(f"{names[i]} contains {v} litres" for i, v in enumerate(start))
            start_text = f"At the start, {state}."
        else:
            start_text = "At the start, every jug is empty."
        question = (
            f"You have {p.jugs} water jugs with no markings: {jugs}. {start_text} A tap gives "
            "unlimited water and water can be poured away. The allowed moves are:\n"
            "- fill X: fill jug X to the top from the tap\n"
            "- empty X: pour all the water in jug X away\n"
            "- pour X Y: pour water from jug X into jug Y until X is empty or Y is full\n"
            f"where X and Y are jug letters ({', '.join(names)}) and X differs from Y. Every move "
            "counts, even one that changes nothing.\n"
            f"Goal: after your last move, at least one jug holds exactly {target} litres, using at "
            f"most {max_moves} moves.\n"
            "Write the moves in order, separated by semicolons (or one per line), "
            "for example: fill A; pour A B; empty B"
        )
        meta = {"capacities": list(capacities), "start": list(start), "target": target,
                "max_moves": max_moves, "shortest": len(plan)}
        return question, "; ".join(format_move(m) for m in plan), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        capacities = tuple(meta["capacities"])
        moves = parse_jug_moves(answer, len(capacities))
        if not moves or len(moves) > meta["max_moves"]:
            return 0.0
        state = tuple(meta["start"])
        for move in moves:
            state = apply_move(state, capacities, move)
        return 1.0 if meta["target"] in state else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        n = len(instance.metadata["capacities"])
        gold = parse_jug_moves(instance.answer, n) or []
        texts = [format_move(m) for m in gold]
        unknown = JUG_NAMES[n] if n < len(JUG_NAMES) else "E"
        k = rng.randrange(len(texts))
        padding = instance.metadata["max_moves"] - len(texts) + 1
        candidates = [
            texts[:-1],                                             # shorter than the shortest plan
            texts + [texts[-1]] * padding,                          # one move over the limit
            texts[:k] + [f"fill {unknown}"] + texts[k + 1:],        # a jug that does not exist
        ]
        for _ in range(6):   # a changed move, when it breaks the plan
            changed = list(texts)
            i = rng.randrange(len(changed))
            changed[i] = format_move(rng.choice(jug_moves(n)))
            candidates.append(changed)
        out: list[str] = []
        for moves in candidates:
            text = "; ".join(moves)
            if text and text != instance.answer and text not in out and self.check(instance, text) == 0.0:
                out.append(text)
        return out[:4]


# --- dyck reasoning errors ----------------------------------------------------------------------

def push_or_pop(stack: list[str], symbol: str) -> list[str]:
    """The stack after reading ``symbol``: an opener is pushed, a closer removes the top."""
    return stack + [symbol] if symbol in OPENERS else stack[:-1]


def format_stack(stack: list[str]) -> str:
    return " ".join(stack) if stack else "empty"


@uniqueness_check
def find_erroneous_steps(symbols: list[str], stacks: list[list[str]], completion: list[str]) -> list[int]:
    """1-based numbers of the wrong steps of a stack trace: step k (reading symbols[k-1]) is wrong
    when its stack is not the previous step's stated stack updated by that symbol; the last step
    (number len(symbols) + 1) when its completion does not close the last stated stack.
    Raises ValueError where a closer meets a stack whose top is not its opener (no defined step)."""
    wrong = []
    previous: list[str] = []
    for k, (symbol, stack) in enumerate(zip(symbols, stacks), start=1):
        if symbol not in OPENERS and (not previous or CLOSER[previous[-1]] != symbol):
            raise ValueError(f"step {k} reads {symbol!r} onto a stack that does not end in its opener")
        if stack != push_or_pop(previous, symbol):
            wrong.append(k)
        previous = stack
    if completion != [CLOSER[o] for o in reversed(previous)]:
        wrong.append(len(symbols) + 1)
    return wrong


def mutate_stack(rng: random.Random, stack: list[str], bottom: int, openers: list[str]) -> list[str]:
    """``stack`` changed only in its first ``bottom`` entries (those never popped again), so every
    later closer still meets its own opener on top."""
    out = list(stack)
    if bottom == 0:   # earlier mistakes dropped them all: only a bracket slipped in below is left
        out.insert(0, rng.choice(openers))
        return out
    kinds = ["retype", "drop", "extra"]
    if any(stack[i] != stack[i + 1] for i in range(bottom - 1)):
        kinds.append("swap")
    kind = rng.choice(kinds)
    i = bottom - 1 if rng.random() < 0.5 else rng.randrange(bottom)
    if kind == "retype":
        out[i] = rng.choice([o for o in openers if o != out[i]])
    elif kind == "drop":
        del out[i]
    elif kind == "extra":
        out.insert(i + 1, rng.choice(openers))
    else:
        pairs = [j for j in range(bottom - 1) if out[j] != out[j + 1]]
        j = rng.choice(pairs)
        out[j], out[j + 1] = out[j + 1], out[j]
    return out


def mutate_completion(rng: random.Random, closing: list[str], closers: list[str]) -> list[str]:
    kinds = ["retype", "extra"] + (["drop"] if len(closing) > 1 else [])
    if any(closing[i] != closing[i + 1] for i in range(len(closing) - 1)):
        kinds.append("swap")
    kind = rng.choice(kinds)
    out = list(closing)
    i = rng.randrange(len(out))
    if kind == "retype":
        out[i] = rng.choice([c for c in closers if c != out[i]])
    elif kind == "drop":
        del out[i]
    elif kind == "extra":
        out.insert(i, rng.choice(closers))
    else:
        j = rng.choice([j for j in range(len(out) - 1) if out[j] != out[j + 1]])
        out[j], out[j + 1] = out[j + 1], out[j]
    return out


def parse_step_set(answer: str) -> set[int] | None:
    """Step numbers of an answer ("3, 7", "steps 3 and 7"), the empty set for "none", or None."""
    text = normalize_text(answer).strip(" .")
    if text in ("none", "no errors", "no error", "no mistakes", "no mistake", "no steps"):
        return set()
    text = re.sub(r"\b(?:steps?|and)\b", " ", text)
    if not re.fullmatch(r"[\d\s,;]+", text):
        return None
    values = [int(t) for t in re.findall(r"\d+", text)]
    return set(values) if values else None


@dataclass(frozen=True)
class DyckTraceParams(LevelParams):
    pairs: int
    kinds: int
    max_depth: int
    max_errors: int


class DyckReasoningErrors(SynthTask):
    name = "dyck_reasoning_errors"
    family = "language"
    answer_example = "3, 7"
    levels = (DyckTraceParams(4, 2, 3, 1), DyckTraceParams(6, 3, 4, 2), DyckTraceParams(9, 3, 5, 2),
              DyckTraceParams(12, 4, 6, 3), DyckTraceParams(16, 4, 8, 4), DyckTraceParams(22, 4, 10, 5))

    def build(self, rng: random.Random, p: DyckTraceParams) -> tuple[str, str, dict[str, Any]]:
        openers = [o for o, _ in BRACKETS[:p.kinds]]
        closers = [c for _, c in BRACKETS[:p.kinds]]
        seq = random_dyck(rng, p.pairs, p.kinds, p.max_depth)
        depth, cuts = 0, []
        for i, s in enumerate(seq):
            depth += 1 if s in OPENERS else -1
            if depth > 0 and i + 1 >= len(seq) // 2:
                cuts.append(i + 1)
        symbols = seq[:rng.choice(cuts)]
        n = len(symbols)
        true_stacks, stack = [], []
        for s in symbols:
            stack = push_or_pop(stack, s)
            true_stacks.append(stack)
        # persistent[k]: how many bottom entries of the stack after step k+1 are never popped again
        persistent = [0] * n
        low = len(true_stacks[-1])
        for k in range(n - 1, -1, -1):
            low = min(low, len(true_stacks[k]))
            persistent[k] = low
        steps = [k + 1 for k in range(n) if persistent[k] >= 1] + [n + 1]
        count = min(rng.randint(0, p.max_errors), len(steps))
        previous: list[str] = []
        while not previous:   # mistakes that leave nothing open to close are drawn again
            errors = sorted(rng.sample(steps, count))
            stated: list[list[str]] = []
            previous = []
            for k, s in enumerate(symbols):
                stack = push_or_pop(previous, s)
                if k + 1 in errors:
                    live = len(true_stacks[k]) - persistent[k]        # entries above the persistent ones
                    stack = mutate_stack(rng, stack, len(stack) - live, openers)
                stated.append(stack)
                previous = stack
        completion = [CLOSER[o] for o in reversed(previous)]
        if n + 1 in errors:
            completion = mutate_completion(rng, completion, closers)
        found = find_erroneous_steps(symbols, stated, completion)
        assert found == errors, (found, errors)
        lines = [f"Step {k}: read '{s}' ; stack now: {format_stack(st)}"
                 for k, (s, st) in enumerate(zip(symbols, stated), start=1)]
        lines.append(f"Step {n + 1}: close what is still open, top first: {' '.join(completion)}")
        question = (
            "Task: complete this bracket sequence so that every bracket is properly closed:\n"
            f"{' '.join(symbols)}\n"
            "Someone solved it step by step, keeping a stack of the brackets still open (listed "
            "bottom to top): each step reads one bracket, pushing an opening bracket on top or "
            "removing the top bracket for a closing one, and the last step closes what is left.\n"
            + "\n".join(lines) + "\n"
            "A step is erroneous when the stack it states is not the stack stated in the step before "
            "it (the empty stack before step 1) updated by the bracket it reads, or, for the last "
            f"step (step {n + 1}), when its brackets are not the closing brackets of the stack stated "
            f"in step {n}, top first. A step that correctly continues from an earlier mistake is not "
            "erroneous. Which steps are erroneous? Answer with their numbers in increasing order, "
            "separated by commas, or 'none' if no step is erroneous."
        )
        meta = {"symbols": "".join(symbols), "errors": errors}
        return question, ", ".join(map(str, errors)) if errors else "none", meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        got = parse_step_set(answer)
        return 1.0 if got is not None and got == set(instance.metadata["errors"]) else 0.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        errors = list(instance.metadata["errors"])
        n_steps = len(instance.metadata["symbols"]) + 1
        clean = [k for k in range(1, n_steps + 1) if k not in errors]
        out = []
        if errors:
            out.append("none")
            if len(errors) > 1:
                dropped = list(errors)
                del dropped[rng.randrange(len(dropped))]
                out.append(", ".join(map(str, dropped)))
        if clean:
            out.append(", ".join(map(str, sorted(errors + [rng.choice(clean)]))))
        return out


# --- wordscapes ---------------------------------------------------------------------------------

_VOCABULARY_TEXT = """
ACE ACT ADD AGE AGO AID AIM AIR ALE ALL AND ANT ANY APE ARC ARE ARK ARM ART ASH ASK ATE AWE AXE
BAD BAG BAN BAR BAT BAY BED BEE BET BID BIG BIN BIT BOW BOX BOY BUD BUG BUN BUS BUT BUY CAB CAN
CAP CAR CAT COT COW CRY CUB CUP CUT DAD DAY DEN DEW DID DIG DIM DIP DOE DOG DOT DRY DUE DUG EAR
EAT EEL EGG ELF ELM END ERA EVE EYE FAN FAR FAT FED FEW FIG FIN FIR FIT FIX FLY FOE FOG FOR FOX
FRY FUN FUR GAP GAS GEM GET GUM GUN GUT GUY HAD HAM HAS HAT HEN HER HID HIM HIP HIS HIT HOG HOP
HOT HOW HUB HUE HUG HUT ICE ICY ILL INK INN ION IVY JAM JAR JAW JET JOB JOG JOY KEY KID KIN KIT
LAB LAD LAP LAW LAY LED LEG LET LID LIE LIP LIT LOG LOT LOW MAD MAN MAP MAT MAY MEN MET MIX MOB
MOP MUD MUG NAP NET NEW NOD NOR NOT NOW NUT OAK OAR OAT ODD OFF OIL OLD ONE OUR OUT OWE OWL OWN
PAD PAN PAT PAW PAY PEA PEN PET PIE PIG PIN PIT POD POT PUT RAG RAM RAN RAT RAW RAY RED RIB RID
RIM RIP ROD ROT ROW RUB RUG RUN SAD SAP SAT SAW SAY SEA SEE SET SEW SHE SHY SIP SIR SIT SIX SKI
SKY SLY SON SOW SOY SPA SPY SUM SUN TAB TAG TAN TAP TAR TEA TEN THE TIE TIN TIP TOE TON TOO TOP
TOY TRY TUB TUG TWO URN USE VAN VET VOW WAR WAS WAX WAY WEB WET WHO WHY WIG WIN WIT WOE WON YAK
YAM YES YET YOU ZIP ZOO
ABLE ACHE ACID ACRE ALSO ARCH AREA ARMY AUNT AWAY BABY BACK BAKE BALD BALL BAND BANK BARE BARN
BASE BATH BEAD BEAK BEAM BEAN BEAR BEAT BEEF BELL BELT BEND BEST BIKE BILL BIRD BITE BLUE BOAT
BODY BOIL BOLD BOLT BONE BOOK BOOT BORN BOSS BOTH BOWL BULB BULL BURN BUSY CAKE CALF CALL CALM
CAMP CANE CAPE CARD CARE CART CASE CASH CAST CAVE CELL CHIN CHIP CITY CLAP CLAY CLIP CLUB CLUE
COAL COAT CODE COIN COLD COMB CONE COOK COOL COPE COPY CORD CORE CORN COST COZY CRAB CREW CROP
CROW CUBE CURE CURL DARE DARK DART DASH DATE DAWN DEAL DEAR DECK DEEP DEER DENT DESK DIAL DICE
DIET DIRT DISH DIVE DOCK DOLL DOME DOOR DOSE DOVE DOWN DRAW DROP DRUM DUCK DUNE DUSK DUST DUTY
EACH EARN EAST EASY EDGE ELSE EPIC EVEN EVER EXIT FACE FACT FADE FAIL FAIR FALL FAME FARM FAST
FATE FEAR FEED FEEL FELT FERN FILE FILL FILM FIND FINE FIRE FIRM FISH FIST FLAG FLAT FLEA FLIP
FLOW FOAM FOLD FOLK FOOD FOOT FORK FORM FORT FOUR FROG FUEL FULL GAIN GAME GATE GEAR GIFT GIRL
GIVE GLAD GLOW GLUE GOAL GOAT GOLD GOLF GONE GOOD GOWN GRAB GRIN GRIP GROW GULF HAIL HAIR HALF
HALL HAND HANG HARD HARM HARP HATE HAVE HAWK HEAD HEAL HEAP HEAR HEAT HELD HELP HERB HERD HERE
HERO HIDE HIGH HIKE HILL HINT HIRE HOLD HOLE HOME HOOD HOOK HOPE HORN HOSE HOST HOUR HUGE HUNT
HURT IDEA INCH IRON ITEM JAIL JOKE JUMP JUST KEEN KEEP KICK KIND KING KISS KITE KNEE KNIT KNOT
KNOW LACE LACK LAKE LAMB LAMP LAND LANE LAST LATE LAWN LAZY LEAD LEAF LEAN LEAP LEFT LEND LENS
LESS LIFE LIFT LIKE LIME LINE LINK LION LIST LIVE LOAD LOAF LOAN LOCK LONE LONG LOOK LOOP LORD
LOSE LOSS LOST LOUD LOVE LUCK MADE MAIL MAIN MAKE MALE MANY MARK MASK MAST MATH MEAL MEAN MEAT
MELT MENU MILD MILE MILK MILL MIND MINE MINT MIST MOLE MOOD MOON MORE MOSS MOST MOTH MOVE MUCH
MULE MUST NAIL NAME NEAR NEAT NECK NEED NEST NEXT NICE NINE NONE NOON NOSE NOTE OATH OKAY ONCE
ONLY OPEN OVAL OVEN OVER PACE PACK PAGE PAIN PAIR PALE PALM PARK PART PAST PATH PEAK PEAR PEEL
PINE PINK PIPE PLAN PLAY PLOT PLUM POEM POET POLE POND POOL POOR PORT POSE POST POUR PRAY PULL
PUMP PURE PUSH RACE RAFT RAGE RAIL RAIN RAMP RANK RARE RATE READ REAL REAR REST RICE RICH RIDE
RING RIPE RISE RISK ROAD ROAR ROBE ROCK ROLE ROLL ROOF ROOM ROOT ROPE ROSE RUDE RULE RUSH RUST
SAFE SAIL SALE SALT SAME SAND SAVE SCAR SEAL SEAT SEED SEEK SEEM SELF SELL SEND SHIP SHOE SHOP
SHOT SHOW SHUT SICK SIDE SIGN SILK SING SINK SIZE SKIN SLED SLIM SLIP SLOW SNOW SOAP SOCK SOFA
SOFT SOIL SOLD SOLE SOME SONG SOON SORT SOUL SOUP SOUR SPIN SPOT STAR STAY STEM STEP STIR STOP
SUCH SUIT SURE SWAN SWIM TAIL TAKE TALE TALK TALL TAME TANK TAPE TASK TEAM TEAR TELL TENT TERM
TEST TEXT THAN THAT THEM THEN THEY THIN THIS TIDE TIDY TILE TIME TINY TIRE TOAD TOLD TONE TOOL
TOUR TOWN TRAP TRAY TREE TRIM TRIP TRUE TUBE TUNE TURN TWIN TYPE UNIT UPON VASE VAST VERB VERY
VEST VIEW VINE VOTE WADE WAGE WAIT WAKE WALK WALL WAND WANT WARM WARN WASH WAVE WEAK WEAR WEED
WEEK WELL WENT WEST WHAT WHEN WHIP WIDE WIFE WILD WILL WIND WINE WING WINK WIRE WISE WISH WITH
WOLF WOOD WOOL WORD WORE WORK WORM WRAP YARD YARN YEAR YELL YOUR ZERO ZONE
ABOUT ABOVE ACORN ACTOR ADULT AFTER AGAIN AGENT AGREE AHEAD ALARM ALERT ALIKE ALIVE ALLOW ALONE
ALONG ALTER ANGEL ANGER ANGLE ANGRY ANKLE APART APPLE APRON ARENA ARGUE ARISE AROMA ARROW ASIDE
AWAKE AWARD AWARE BACON BADGE BAKER BASIC BEACH BEAST BEGIN BEING BELOW BENCH BERRY BIRTH BLACK
BLADE BLAME BLANK BLAST BLEND BLIND BLOCK BLOOM BOARD BOAST BONUS BOOST BRAIN BRAKE BRAND BRAVE
BREAD BREAK BRICK BRIDE BRIEF BRING BROAD BROOM BROWN BRUSH BUILD BUNCH CABIN CABLE CAMEL CANDY
CANOE CARGO CARRY CATCH CAUSE CHAIN CHAIR CHALK CHARM CHART CHASE CHEAP CHECK CHEEK CHEER CHESS
CHEST CHIEF CHILD CHILL CLAIM CLASS CLEAN CLEAR CLERK CLIMB CLOCK CLOSE CLOTH CLOUD CLOWN COACH
COAST CORAL COUNT COURT COVER CRAFT CRANE CRASH CREAM CRIME CROSS CROWD CROWN CRUST CURVE CYCLE
DAILY DAIRY DANCE DEALT DELAY DEPTH DINER DIRTY DOUBT DOUGH DOZEN DRAFT DRAIN DRAMA DREAM DRESS
DRIFT DRILL DRINK DRIVE EAGER EAGLE EARLY EARTH EIGHT ELBOW EMPTY ENJOY ENTER EQUAL ERROR EVENT
EXACT EXTRA FABLE FAINT FAITH FALSE FANCY FEAST FENCE FERRY FIELD FIFTY FINAL FIRST FLAME FLASH
FLOAT FLOOR FLOUR FLUTE FOCUS FORCE FORGE FRAME FRESH FRONT FROST FRUIT FUNNY GHOST GIANT GLASS
GLOBE GLOVE GRACE GRADE GRAIN GRAND GRAPE GRASS GREAT GREEN GREET GROUP GUARD GUESS GUEST GUIDE
HABIT HAPPY HEART HEAVY HEDGE HONEY HORSE HOTEL HOUSE HUMAN HUMOR IDEAL IMAGE INDEX INNER IVORY
JELLY JUDGE JUICE KNIFE KNOCK LABEL LARGE LASER LATER LAUGH LAYER LEARN LEAST LEAVE LEMON LEVEL
LIGHT LIMIT LINEN LOCAL LODGE LOYAL LUCKY LUNCH MAGIC MAJOR MAPLE MARCH MATCH MAYOR MEDAL METAL
MINOR MODEL MONEY MONTH MOUSE MOUTH MOVIE MUSIC NERVE NEVER NIGHT NOBLE NOISE NORTH NOVEL NURSE
OCEAN OFFER OFTEN OLIVE ONION OPERA ORBIT ORDER OTHER OTTER OUTER PAINT PANEL PAPER PARTY PASTA
PATCH PEACE PEACH PEARL PENNY PHONE PIANO PIECE PILOT PITCH PIZZA PLACE PLAIN PLANE PLANT PLATE
POINT POLAR PORCH POUND POWER PRESS PRICE PRIDE PRINT PRIZE PROUD PUPIL QUEEN QUICK QUIET QUOTE
RADIO RAISE RANCH RANGE RAPID RAVEN REACH READY RIDER RIGHT RIVER ROAST ROBIN ROBOT ROUND ROUTE
ROYAL RULER SALAD SAUCE SCALE SCARF SCENE SCORE SCOUT SENSE SEVEN SHADE SHAKE SHAPE SHARE SHARP
SHEEP SHELF SHELL SHINE SHIRT SHORE SHORT SHOUT SIGHT SKATE SKILL SLEEP SLICE SLIDE SLOPE SMALL
SMART SMILE SMOKE SNACK SNAKE SOLID SOLVE SOUND SOUTH SPACE SPARE SPARK SPEAK SPEED SPELL SPEND
SPICE SPINE SPOON SPORT STAGE STAIR STAMP STAND START STEAM STEEL STICK STILL STONE STORE STORM
STORY STOVE STRAW STUDY STYLE SUGAR SUNNY SWEET SWING TABLE TASTE TEACH TEETH THEME THICK THING
THINK THREE THROW THUMB TIGER TOAST TODAY TOOTH TOPIC TORCH TOTAL TOUCH TOWEL TOWER TRACE TRACK
TRADE TRAIL TRAIN TREAT TREND TRIAL TRICK TRUCK TRUNK TRUST TRUTH TULIP UNCLE UNDER UNION UNTIL
UPPER URBAN USUAL VALUE VIDEO VISIT VOICE WAGON WATCH WATER WHALE WHEAT WHEEL WHITE WHOLE WOMAN
WORLD WORRY WRIST WRITE YIELD YOUNG YOUTH ZEBRA
"""
VOCABULARY = tuple(_VOCABULARY_TEXT.split())   # common words, no names, abbreviations or plurals
VOCABULARY_SET = frozenset(VOCABULARY)   # membership tests only, never iterated
EXTRA_LETTERS = "AEIOURSTLNDHCMP"
ACROSS, DOWN = "across", "down"
STEP = {ACROSS: (0, 1), DOWN: (1, 0)}

Cell = tuple[int, int]
Slot = tuple[int, int, str, int]   # (row, col, direction, length), 0-based


_LETTER_COUNTS = {w: tuple(Counter(w).items()) for w in VOCABULARY}


def spellable(word: str, bag: Counter) -> bool:
    items = _LETTER_COUNTS.get(word) or Counter(word).items()
    return all(bag[ch] >= k for ch, k in items)


@functools.lru_cache(maxsize=4096)
def bag_words(bag: str) -> tuple[str, ...]:
    """Vocabulary words spellable from the letters of ``bag`` (vocabulary order)."""
    counts = Counter(bag)
    return tuple(w for w in VOCABULARY if spellable(w, counts))


def slot_cells(slot: Slot) -> list[Cell]:
    r, c, d, n = slot
    dr, dc = STEP[d]
    return [(r + k * dr, c + k * dc) for k in range(n)]


def slot_crossings(slots: list[Slot]) -> list[tuple[int, int, int, int]]:
    """(slot a, letter i, slot b, letter j), 0-based, for every cell two slots share."""
    out = []
    for a in range(len(slots)):
        for b in range(a + 1, len(slots)):
            cells_b = slot_cells(slots[b])
            for i, cell in enumerate(slot_cells(slots[a])):
                if cell in cells_b:
                    out.append((a, i, b, cells_b.index(cell)))
    return out


@uniqueness_check
def solve_wordscape(slots: list[Slot], bag: str, revealed: dict[Cell, str], limit: int = 2) -> list[list[str]]:
    """Up to ``limit`` fillings of the slots with distinct vocabulary words spellable from the bag
    that agree on shared cells and revealed letters."""
    cells = [slot_cells(s) for s in slots]
    words_in_bag = bag_words("".join(sorted(bag)))
    options = []
    for s, slot_cell_list in zip(slots, cells):
        options.append([w for w in words_in_bag if len(w) == s[3]
                        and all(revealed.get(cell, ch) == ch for cell, ch in zip(slot_cell_list, w))])
    # most constrained first, then always a slot crossing one already placed when there is one
    order: list[int] = []
    remaining = list(range(len(slots)))
    while remaining:
        placed = {cell for i in order for cell in cells[i]}
        touching = [i for i in remaining if any(cell in placed for cell in cells[i])] or remaining
        best = min(touching, key=lambda i: len(options[i]))
        order.append(best)
        remaining.remove(best)
    found: list[list[str]] = []
    words: list[str | None] = [None] * len(slots)
    letters: dict[Cell, list[str]] = {}

    def search(k: int) -> None:
        if len(found) >= limit:
            return
        if k == len(order):
            found.append([w for w in words if w is not None])
            return
        i = order[k]
        for w in options[i]:
            if w in words or any(letters[cell][0] != ch for cell, ch in zip(cells[i], w) if letters.get(cell)):
                continue
            words[i] = w
            for cell, ch in zip(cells[i], w):
                letters.setdefault(cell, []).append(ch)
            search(k + 1)
            for cell in cells[i]:
                letters[cell].pop()
            words[i] = None

    search(0)
    return found


def place_words(rng: random.Random, first: str, words: list[str], count: int) -> list[tuple[Slot, str]] | None:
    """``count`` words on a grid, each after the first crossing an earlier one at a shared letter,
    with no other contact between words; None when the words do not fit."""
    placed: list[tuple[Slot, str]] = [((0, 0, ACROSS, len(first)), first)]
    grid: dict[Cell, str] = {(0, c): ch for c, ch in enumerate(first)}
    dirs: dict[Cell, list[str]] = {(0, c): [ACROSS] for c in range(len(first))}
    while len(placed) < count:
        used = [w for _, w in placed]
        options = []
        for w in words:
            if w in used:
                continue
            for (r, c, d, n), word in placed:
                nd = DOWN if d == ACROSS else ACROSS
                dr, dc = STEP[d]
                for i in range(n):
                    cell = (r + i * dr, c + i * dc)
                    if len(dirs[cell]) > 1:
                        continue
                    for j, ch in enumerate(w):
                        if ch != word[i]:
                            continue
                        ndr, ndc = STEP[nd]
                        slot = (cell[0] - j * ndr, cell[1] - j * ndc, nd, len(w))
                        if fits(slot, w, grid, dirs):
                            options.append((slot, w))
        if not options:
            return None
        slot, w = options[rng.randrange(len(options))]
        placed.append((slot, w))
        for cell, ch in zip(slot_cells(slot), w):
            grid[cell] = ch
            dirs.setdefault(cell, []).append(slot[2])
    return placed


def fits(slot: Slot, word: str, grid: dict[Cell, str], dirs: dict[Cell, list[str]]) -> bool:
    r, c, d, n = slot
    dr, dc = STEP[d]
    if (r - dr, c - dc) in grid or (r + n * dr, c + n * dc) in grid:
        return False
    for (cr, cc), ch in zip(slot_cells(slot), word):
        if (cr, cc) in grid:
            if grid[(cr, cc)] != ch or dirs[(cr, cc)] != [DOWN if d == ACROSS else ACROSS]:
                return False
        elif (cr + dc, cc + dr) in grid or (cr - dc, cc - dr) in grid:   # side neighbours
            return False
    return True


def parse_word_answer(answer: str) -> list[str] | None:
    tokens = [t for t in re.split(r"[\s,;]+", answer.strip()) if t]
    tokens = [t for t in tokens if not re.fullmatch(r"\(?\d+[.):]?", t)]    # slot numbers
    if not all(t.isascii() and t.isalpha() for t in tokens):
        return None
    return [t.upper() for t in tokens]


@dataclass(frozen=True)
class WordscapesParams(LevelParams):
    slots: int
    extra_letters: int     # letters in the bag beyond those of the longest word
    first_letters: bool    # every slot's first letter is shown


class Wordscapes(SynthTask):
    name = "wordscapes"
    family = "language"
    answer_example = "STAR, RATE, TEAR"
    levels = (WordscapesParams(2, 0, True), WordscapesParams(3, 0, True), WordscapesParams(3, 1, False),
              WordscapesParams(4, 1, False), WordscapesParams(5, 1, False), WordscapesParams(5, 2, False))

    def build(self, rng: random.Random, p: WordscapesParams) -> tuple[str, str, dict[str, Any]]:
        longest = [w for w in VOCABULARY if len(w) == 5]
        while True:
            first = rng.choice(longest)
            bag = list(first) + [rng.choice(EXTRA_LETTERS) for _ in range(p.extra_letters)]
            words = [w for w in bag_words("".join(sorted(bag))) if w != first]
            if len(words) < p.slots:
                continue
            placed = place_words(rng, first, words, p.slots)
            if placed is not None:
                break
        rng.shuffle(bag)
        top = min(s[0] for s, _ in placed)
        left = min(s[1] for s, _ in placed)
        placed = sorted((((r - top, c - left, d, n), w) for (r, c, d, n), w in placed),
                        key=lambda item: (item[0][0], item[0][1], item[0][2] != ACROSS))
        slots = [s for s, _ in placed]
        gold = [w for _, w in placed]
        solution: dict[Cell, str] = {}
        for slot, w in placed:
            solution.update(zip(slot_cells(slot), w))
        revealed: dict[Cell, str] = {}
        if p.first_letters:
            for slot, w in placed:
                revealed[(slot[0], slot[1])] = w[0]
        while True:
            found = solve_wordscape(slots, "".join(bag), revealed)
            if len(found) == 1:
                break
            other = found[0] if found[0] != gold else found[1]
            differ = sorted({cell for slot, w_gold, w_other in zip(slots, gold, other)
                             for cell, a, b in zip(slot_cells(slot), w_gold, w_other) if a != b})
            cell = differ[rng.randrange(len(differ))]
            revealed[cell] = solution[cell]
        assert found == [gold]
        rows = 1 + max(r for r, _ in solution)
        cols = 1 + max(c for _, c in solution)
        picture = "\n".join(" ".join(revealed.get((r, c), "." if (r, c) in solution else "#")
                                     for c in range(cols)) for r in range(rows))
        slot_lines = [f"{k}. {d}, starting at row {r + 1}, column {c + 1}, {n} letters"
                      for k, (r, c, d, n) in enumerate(slots, start=1)]
        crossing_lines = [f"letter {i + 1} of slot {a + 1} = letter {j + 1} of slot {b + 1}"
                          for a, i, b, j in slot_crossings(slots)]
        reveal_lines = [f"row {r + 1}, column {c + 1}: {ch}" for (r, c), ch in sorted(revealed.items())]
        question = (
            f"Word puzzle. Letter bag: {' '.join(bag)}\n"
            "Fill every slot of the grid with a different common English word (no names, "
            "abbreviations or plurals). Each word must be spelled from the letter bag, using each "
            "letter at most as many times as it appears in the bag; different words may reuse the "
            "same letters. Words that share a cell must agree on its letter.\n"
            "Grid (rows and columns numbered from 1; '.' is a cell to fill, a letter is a revealed "
            "cell, '#' is not part of the puzzle):\n" + picture + "\n"
            "Slots (across words read left to right, down words top to bottom):\n" + "\n".join(slot_lines)
            + "\nCrossings: " + ("; ".join(crossing_lines) or "none")
            + "\nRevealed letters: " + ("; ".join(reveal_lines) or "none")
            + "\nAnswer with the words in slot order, separated by commas."
        )
        meta = {"bag": "".join(sorted(bag)), "slots": [list(s) for s in slots],
                "revealed": [[r, c, ch] for (r, c), ch in sorted(revealed.items())]}
        return question, ", ".join(gold), meta

    def check(self, instance: TaskInstance, answer: str) -> float:
        meta = instance.metadata
        slots = [tuple(s) for s in meta["slots"]]
        words = parse_word_answer(answer)
        if words is None or len(words) != len(slots) or len(set(words)) != len(words):
            return 0.0
        counts = Counter(meta["bag"])
        grid: dict[Cell, str] = {(r, c): ch for r, c, ch in meta["revealed"]}
        for slot, w in zip(slots, words):
            if w not in VOCABULARY_SET or len(w) != slot[3] or not spellable(w, counts):
                return 0.0
            for cell, ch in zip(slot_cells(slot), w):
                if grid.setdefault(cell, ch) != ch:
                    return 0.0
        return 1.0

    def perturbations(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        gold = [w.strip() for w in instance.answer.split(",")]
        out = [", ".join(gold[:-1]), ", ".join(gold[1:] + gold[:1])]
        changed = list(gold)
        i = rng.randrange(len(changed))
        k = rng.randrange(len(changed[i]))
        letter = rng.choice([ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch != changed[i][k]])
        changed[i] = changed[i][:k] + letter + changed[i][k + 1:]
        out.append(", ".join(changed))
        return [a for a in out if a and a != instance.answer and self.check(instance, a) == 0.0]
