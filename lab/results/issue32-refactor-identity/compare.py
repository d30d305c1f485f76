import json, sys
def load(p):
    r = json.load(open(p))
    return {(x['question_id'], x['turn'], x['repeat'], x['method']): x['token_ids'] for x in r['records']}
for part in sys.argv[1:]:
    a, b = load(f'before-{part}/results.json'), load(f'after-{part}/results.json')
    same = sum(a[k] == b.get(k) for k in a)
    print(part, f"{same}/{len(a)} identical", "keys equal" if a.keys() == b.keys() else "KEYS DIFFER",
          [k for k in a if a[k] != b.get(k)])
